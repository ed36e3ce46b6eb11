"""Where weights live and how they reach the GPU: the memory plan (plan.py, pure Python: what stays
resident, what streams), the device pool (pool.py), the CUDA driver through ctypes (driver.py), the
upload lanes and their Python twin (lanes.py, upload.py), the start-of-process preload (preload.py),
the streamed layers' window (window.py) and the bytes a weight is stored as (host_weights.py)."""
