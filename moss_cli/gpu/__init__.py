"""The GPU runners, a layer above the op tables: the text encoder (encoder.py), the DiT's sampling loop
(denoiser.py), the VAE decoder (decoder.py) and encoder (image_encoder.py), each captured as CUDA graphs over
the process's pool (capture.py), and LoRA merged into their resident weights (lora_merge.py). Importing these
modules needs the GPU extra."""
