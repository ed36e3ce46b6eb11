import sys
from pathlib import Path

# scripts/reference holds the torch statements of the model math the tests hold our code against
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
