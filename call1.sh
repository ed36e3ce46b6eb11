export PACK=$OUT/all.tgz
OUT=/tmp/o1 ENCODER_ARGS=--quick STEP_TIMEOUT=200 timeout 590 bash scripts/gpu_run.sh tests dit decoder picture load encoder baseline tables
