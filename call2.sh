O=/tmp/o-$(date +%s)
export PACK=$OUT/all.tgz
OUT=$O STEP_TIMEOUT=420 GPU_TESTS="tests/gpu/test_cli_gpu.py tests/gpu/test_columns_gpu.py tests/gpu/test_cuda_encoder_tiny.py tests/gpu/test_decoder_gpu.py tests/gpu/test_denoiser_tiny.py tests/gpu/test_kernel_cache.py tests/gpu/test_pool_gpu.py tests/gpu/test_upload_lanes_gpu.py" timeout 585 bash scripts/gpu_run.sh tests contract
