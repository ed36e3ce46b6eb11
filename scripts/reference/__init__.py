"""Independent statements of the model math in torch, used by the tests and by regenerate_cases.py.

Nothing here imports moss_cli: these are the sources our numpy code is held against.
"""
