"""The GPU runners, a layer above the op tables: the text encoder (encoder.py), the DiT's sampling loop
(denoiser.py) and the VAE decoder (decoder.py), each captured as CUDA graphs over the process's pool
(capture.py). Importing these modules needs the GPU extra."""
