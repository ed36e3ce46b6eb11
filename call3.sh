O=/tmp/o-$(date +%s)
export PACK=$OUT/all.tgz
OUT=$O STEP_TIMEOUT=300 timeout 400 bash scripts/gpu_run.sh load
