#!/usr/bin/env bash
# The device run: set up the GPU image's Python, then run the named steps, logs under $OUT (or ./gpu_out).
#   bash scripts/gpu_run.sh contract tests encoder delta bench   (GPU_TESTS=path: the tests step runs those only)
#   NCU_GROUPS="flash chunked" NCU_KERNELS="flash|setup|walk" bash scripts/gpu_run.sh ncu   (scripts/gpu_ncu_kernels.py)
# Steps: contract (every kernel against its float64 reference at real shapes), tests (pytest tests/gpu but the
# cuBLASLt tuning's tests; after a passing contract step in the same call, without the contract's own test),
# tuning (tests/gpu/test_gemm_tuning.py: every candidate of five tuned products, ~5 minutes, a call of its own),
# encoder (9B encoder accuracy and speed), delta (the delta rule alone), bench (cuBLASLt products against
# torch), ncu (Nsight Compute on named launch groups), gaps (the encoder graph's idle time under CUPTI),
# dit (the DiT at real size: accuracy against float64 and speed, ours beside torch eager and torch.compile;
# DIT_ARGS="--compile-modes default max-autotune-no-cudagraphs" picks the modes; --speed-only: the step times
# alone, ~4 minutes less), decoder (ours against torch's fp32 and TF32 statement and torch.compile of the TF32
# one at 512, 1024 and 2048: scripts/gpu_decoder.py $DECODER_ARGS, then tests/gpu/test_decoder_gpu.py), load (a random real-size folder in
# $LOAD_MODEL, default /tmp/moss-real, made if absent; then scripts/gpu_load.py $LOAD_ARGS on it), picture
# (the whole picture from that folder on the GPU: scripts/gpu_picture.py $PICTURE_ARGS, then a second process;
# PICTURE_PROFILE=1 adds a third under cProfile, picture_profile.txt; PICTURE_COLD=1 one more on a cold page
# cache, picture_cold.json; PICTURE_AB="lanes lanes-late feeder" then processes with each uploader in turn, PICTURE_AB_ROUNDS
# rounds (default 2), picture_ab-UPLOADER-ROUND.json), image (`moss-image --device cuda` on that folder at its
# defaults, 1024x1024, 50 steps, guidance 3, three times, each timed from the command to its exit: the first on a
# fresh machine compiles every kernel), budget (moss-image at 1024x1024 with all but 24, 16, 12 and 8 GB of the GPU held
# by a second process: scripts/gpu_budget.py $BUDGET_ARGS), server (moss-server on that folder: the first request, then one
# client and four at once, scripts/server_bench.py $SERVER_ARGS, server.json), kernels (every kernel the product runs recorded in an empty
# cache folder by moss-image runs: the tiny checkpoint, that folder at 512, 1024 and 2048, a streamed plan, no CFG,
# a long prompt; then the prebuilt files built from it into cuda_kernels/prebuilt/ and $OUT/prebuilt/, so that later steps'
# first processes load their kernels instead of compiling them), cost (where a moss-image call's time goes, from the
# command to its exit, on that folder: first processes with an empty kernel cache and warm ones at 512 and 1024,
# three each, then the chained commands: scripts/gpu_call_cost.py $COST_ARGS (--profile: one more warm call under
# cProfile, $COST_NAME_profile.txt), into $COST_NAME.json, default
# call_cost.json; COST_BEFORE=DIR first runs a tree's sources, e.g. `git archive REV moss_cli cuda_kernels`
# unpacked there, into ${COST_NAME}_before.json, with $COST_BEFORE_ARGS or else $COST_ARGS), vae_encoder (the VAE encoder at 1024x1024 against diffusers' AutoencoderKLFlux2 in fp32 and TF32
# and torch.compile of the TF32 one (--compile-modes picks the modes, none for eager only), speed and accuracy
# against float64: scripts/gpu_vae_encoder.py $VAE_ENCODER_ARGS, vae_encoder.json; then
# tests/gpu/test_vae_encoder_gpu.py and test_img2img_gpu.py, diffusers on the path for this step alone, from
# .wheels/diffusers), lora (a random rank-64 adapter on every DiT linear of that folder: the GPU merge's time, steps with
# and without it, moss-server's switches between it and the base: scripts/gpu_lora.py $LORA_ARGS), tables (BENCHMARKS.md's
# tables from this run's outputs: scripts/bench_tables.py), same (the tiny checkpoint's artifacts on the GPU from the tree
# in $SAME_TREE, default before/, e.g. `git archive c556c19 moss_cli cuda_kernels | tar x -C before`, against this
# one's, tensor for tensor: scripts/gpu_same_artifacts.py, same.json), baseline (transformers' encoder with and without
# flash-linear-attention, wheels in .wheels/fla, beside ours, each also under torch.compile: scripts/gpu_encoder_baseline.py). The benchmark
# run in one call (under 10 minutes):
#   ENCODER_ARGS=--quick bash scripts/gpu_run.sh dit decoder load picture encoder baseline tables
# Wheels for what the image lacks are read from .wheels/ (cp312, manylinux x86_64), made with
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .wheels numpy==2.4.6 nvmath-python==1.0.1 \
#     nvidia-cudnn-frontend fastapi starlette uvicorn pydantic pydantic-core annotated-types typing-inspection \
#     openai distro jiter sniffio httpx2 httpcore2 truststore opentelemetry-api python-multipart
# (numpy 2.4 for numba-cuda 0.30.4; the server's stack, whose fastapi imports opentelemetry-api, and the openai client,
# which imports httpx2, for tests/gpu/test_server_gpu.py),
# and diffusers for the vae_encoder step alone, in its own folder (the image has its other needs: huggingface-hub,
# safetensors, regex, requests, filelock, pillow; importlib_metadata is the standard library's on 3.12):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 -d .wheels/diffusers diffusers==0.42.1
# and flash-linear-attention for the baseline step's second run, likewise:
#   pip download ... -d .wheels/fla flash-linear-attention==0.6.0 fla-core==0.6.0
set -uo pipefail
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
touch "$OUT/.call-start"    # what this call writes is newer: a folder used before keeps its files, unpacked
: > "$OUT/steps.txt"
if ls .wheels/*.whl >/dev/null 2>&1; then
  # byte-compiled, as an install is: a process start that measures the load must not compile their sources
  python3 -m pip install -q --no-index --no-deps --no-cache-dir --upgrade --target /tmp/site .wheels/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS=0
# a step that hangs must not take the others with it (seconds per step; STEP_TIMEOUT overrides)
limit="timeout ${STEP_TIMEOUT:-900}"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import numpy, numba, numba_cuda, nvmath, cuda.core, torch, transformers; print('numpy', numpy.__version__, 'numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'nvmath', nvmath.__version__, 'cuda.core', cuda.core.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/device.txt"
python3 -c "from cuda_kernels import sdpa; print(sdpa.available())" 2>&1 | tee -a "$OUT/device.txt"
# PACK=FILE: the logs with this machine's paths replaced, and every output this call wrote, packed into FILE as
# well, after each step (a device call brings back at most 8 files, and a call cut short keeps what its finished
# steps packed):
#   PACK=$OUT/all.tgz OUT=/tmp/o bash scripts/gpu_run.sh ...   (PACK first, so $OUT is the call's)
pack() {
  [ -z "${PACK:-}" ] && return 0
  local new
  mapfile -t new < <(cd "$OUT" && find . -type f -newer .call-start ! -name "$(basename "$PACK")" | sort)
  [ ${#new[@]} -eq 0 ] && return 0
  (cd "$OUT" && for f in "${new[@]}"; do
     case $f in *.txt|*.log|*.json)
       sed -i "s#/tmp/pytest-of-[A-Za-z0-9_]*#PYTEST_TMP#g; s#/opt/torch#TORCH#g; s#$HOME#HOME#g" "$f" ;; esac
   done)
  # the archive is made outside $OUT (one written into the folder tar reads changes it under tar) and moved in
  local part="${TMPDIR:-/tmp}/pack-$$.tgz"
  tar czf "$part" -C "$OUT" "${new[@]}" && mv "$part" "$PACK"
}
status=0
for step in "$@"; do
  echo "== $step" | tee -a "$OUT/steps.txt"
  start=$(date +%s)
  case $step in
    contract) $limit python3 -m cuda_kernels.contract --size real ${CONTRACT_ARGS:-} 2>&1 | tee "$OUT/contract.txt" ;;
    bench) $limit python3 scripts/gpu_bench_gemm.py 2>&1 | tee "$OUT/gemm.txt" ;;
    tests) skip=()     # the contract step passed in this call: its pytest twin would only run it again
           if [ "${contract_ok:-0}" = 1 ]; then
             skip=(--deselect tests/gpu/test_cuda_contract_gpu.py::test_contract_at_real_shapes)
             echo "the contract passed as this call's contract step: its test is deselected" | tee "$OUT/tests.txt"
           fi
           [ -z "${GPU_TESTS:-}" ] && skip+=(--ignore=tests/gpu/test_gemm_tuning.py)     # the tuning step's
           $limit python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/gpu} "${skip[@]}" -rs -s 2>&1 | tee -a "$OUT/tests.txt" ;;
    tuning) $limit python3 -m pytest -q -p no:cacheprovider tests/gpu/test_gemm_tuning.py -rs -s 2>&1 | tee "$OUT/tuning.txt" ;;
    delta) $limit python3 scripts/gpu_bench_delta.py --out "$OUT/delta.json" 2>&1 | tee "$OUT/delta.txt" ;;
    ncu) $limit ncu --clock-control none --set full -k regex:"${NCU_KERNELS:-gated_delta_rule|nvjet}" \
           -o "$OUT/kernels" python3 scripts/gpu_ncu_kernels.py ${NCU_GROUPS:-} > "$OUT/ncu_log.txt" 2>&1
         ncu --import "$OUT/kernels.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
         ncu --import "$OUT/kernels.ncu-rep" --page source --csv --print-source sass -k regex:"${NCU_KERNELS:-gated_delta_rule}" \
           > "$OUT/ncu_source.csv" 2>&1; tail -5 "$OUT/ncu_log.txt" ;;
    gaps) $limit python3 scripts/gpu_encoder_gaps.py --out "$OUT/gaps.json" 2>&1 | tee "$OUT/gaps.txt" ;;
    dit) # SM clock and power every 0.2 s beside it: a step that slows under sustained load shows there
         nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu --format=csv -lms 200 \
           > "$OUT/dit_clocks.csv" 2>&1 & watch=$!
         $limit python3 scripts/gpu_dit.py --out "$OUT/dit.json" ${DIT_ARGS:-} 2>&1 | tee "$OUT/dit.txt"
         ran=$?; kill $watch 2>/dev/null; (exit $ran) ;;
    decoder) $limit python3 scripts/gpu_decoder.py --out "$OUT" ${DECODER_ARGS:-} 2>&1 | tee "$OUT/decoder.txt"
             $limit python3 -m pytest -q -p no:cacheprovider tests/gpu/test_decoder_gpu.py -rs -s 2>&1 | tee "$OUT/decoder_tests.txt" ;;
    vae_encoder) # diffusers is not on the GPU image: its wheel, for this step only
          python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-diffusers .wheels/diffusers/*.whl &&
          PYTHONPATH=/tmp/site-diffusers:$PYTHONPATH $limit python3 scripts/gpu_vae_encoder.py --out "$OUT" \
            ${VAE_ENCODER_ARGS:-} 2>&1 | tee "$OUT/vae_encoder.txt"
          PYTHONPATH=/tmp/site-diffusers:$PYTHONPATH $limit python3 -m pytest -q -p no:cacheprovider \
            tests/gpu/test_vae_encoder_gpu.py tests/gpu/test_img2img_gpu.py -rs -s 2>&1 | tee "$OUT/vae_encoder_tests.txt" ;;
    encoder) $limit python3 scripts/gpu_encoder_9b.py --out "$OUT/encoder_9b.json" ${ENCODER_ARGS:-} 2>&1 | tee "$OUT/encoder.txt" ;;
    baseline) # transformers' encoder with its torch fallbacks, then with flash-linear-attention (.wheels/fla)
          $limit python3 scripts/gpu_encoder_baseline.py --out "$OUT/encoder_baseline_torch.json" 2>&1 | tee "$OUT/baseline.txt"
          python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site-fla .wheels/fla/*.whl &&
          PYTHONPATH=/tmp/site-fla:$PYTHONPATH $limit python3 scripts/gpu_encoder_baseline.py \
            --out "$OUT/encoder_baseline_fla.json" 2>&1 | tee -a "$OUT/baseline.txt" ;;
    load|picture|image|budget|kernels|cost|server|lora) model=${LOAD_MODEL:-/tmp/moss-real}
          if [ ! -f "$model/model_index.json" ]; then
            rm -rf "$(dirname "$model")/.$(basename "$model")-"*   # a killed writer's staging folder
            $limit python3 scripts/make_real_checkpoint.py "$model" --threads 16 2>&1 | tee "$OUT/make_real.txt"
          fi
          if [ "$step" = kernels ]; then
            rec=$(mktemp -d)
            long=$(python3 -c 'print(", ".join(["a red fox in the snow, morning light, detailed fur"] * 90))')
            # a rank-4 adapter on every DiT matrix of the tiny checkpoint: the GPU merge's kernels recorded too
            python3 -c "import sys; sys.path.insert(0, 'scripts'); import gpu_lora; from moss_cli.checkpoint import open_checkpoint; gpu_lora.make_adapter(open_checkpoint(), 4, '$rec/lora.safetensors')"
            for args in "" "--init-image $rec/p.png --strength 0.5" "--lora $rec/lora.safetensors" "--model $model" "--model $model --width 512 --height 512" \
                        "--model $model --width 2048 --height 2048" "--model $model --gpu-memory 12" \
                        "--model $model --width 512 --height 512 --guidance 1"; do
              echo "recording: moss-image $args" | tee -a "$OUT/kernels.txt"
              NUMBA_CACHE_DIR=$rec $limit python3 -c 'import sys; from moss_cli.cli import image_command; sys.argv[0] = "moss-image"; image_command()' \
                $args --prompt "a red fox" --seed 1 --steps 2 --picture "$rec/p.png" --device cuda --quiet 2>&1 | tee -a "$OUT/kernels.txt"
            done
            NUMBA_CACHE_DIR=$rec $limit python3 -c 'import sys; from moss_cli.cli import image_command; sys.argv[0] = "moss-image"; image_command()' \
              --model "$model" --prompt "$long" --seed 1 --steps 2 --picture "$rec/p.png" --device cuda --quiet 2>&1 | tee -a "$OUT/kernels.txt"
            began=$(date +%s)
            # moss-cli-build-kernels: the lanes' host loop compiled, then the prebuilt files from the recording
            $limit python3 -c 'from moss_cli.cli import build_kernels_command as c; c()' --cache "$rec" \
              --out cuda_kernels/prebuilt 2>&1 | tee -a "$OUT/kernels.txt"
            echo "built in $(( $(date +%s) - began )) s" | tee -a "$OUT/kernels.txt"
            mkdir -p "$OUT/prebuilt" && cp cuda_kernels/prebuilt/*.kernels "$OUT/prebuilt/"
            rm -rf "$rec"
          elif [ "$step" = cost ]; then
            name=${COST_NAME:-call_cost}     # another name keeps a second run (e.g. without prebuilt kernels) beside it
            if [ -n "${COST_BEFORE:-}" ]; then    # an earlier tree's calls first, in the same call (${name}_before)
              $limit python3 scripts/gpu_call_cost.py "$model" --tree "$COST_BEFORE" --out "$OUT/${name}_before.json" \
                ${COST_BEFORE_ARGS:-${COST_ARGS:-}} 2>&1 | tee "$OUT/${name}_before.txt"
            fi
            $limit python3 scripts/gpu_call_cost.py "$model" --out "$OUT/$name.json" ${COST_ARGS:-} 2>&1 | tee "$OUT/$name.txt"
          elif [ "$step" = server ]; then     # moss-server's requests, one client and four: scripts/server_bench.py
            $limit python3 scripts/server_bench.py --model "$model" --device cuda --out "$OUT/server.json" ${SERVER_ARGS:-} 2>&1 | tee "$OUT/server.txt"
          elif [ "$step" = lora ]; then
            $limit python3 scripts/gpu_lora.py "$model" --out "$OUT/lora.json" ${LORA_ARGS:-} 2>&1 | tee "$OUT/lora.txt"
          elif [ "$step" = budget ]; then     # smaller cards emulated: a second process holds the rest
            $limit python3 scripts/gpu_budget.py "$model" --out "$OUT/budget.json" ${BUDGET_ARGS:-} 2>&1 | tee "$OUT/budget.txt"
          elif [ "$step" = load ]; then
            $limit python3 scripts/gpu_load.py "$model" --out "$OUT/load.json" ${LOAD_ARGS:-} 2>&1 | tee "$OUT/load.txt"
          elif [ "$step" = image ]; then     # the command itself, timed from its start to its exit
            for run in 1 2 3; do
              began=$(date +%s.%N)
              $limit python3 -c 'import sys; from moss_cli.cli import image_command; sys.argv[0] = "moss-image"; image_command()' \
                --model "$model" --prompt "a red fox in the snow, morning light, detailed fur" --seed "$run" \
                --picture "$OUT/image-$run.png" --device cuda --quiet 2>&1 | tee -a "$OUT/image.txt"
              ended=$(date +%s.%N)
              python3 -c "import sys; print(f'moss-image --device cuda, 1024x1024, 50 steps, guidance 3, run $run: {float(sys.argv[2]) - float(sys.argv[1]):.2f} s from the command to its exit')" \
                "$began" "$ended" | tee -a "$OUT/image.txt"
            done
          else
            $limit python3 scripts/gpu_picture.py "$model" --out "$OUT/picture.json" ${PICTURE_ARGS:-} 2>&1 | tee "$OUT/picture.txt"
            # a second process: its kernels come from the on-disk cache the first one filled
            $limit python3 scripts/gpu_picture.py "$model" --out "$OUT/picture_again.json" --sizes 512 --steps 4 2>&1 \
              | tee -a "$OUT/picture.txt"
            if [ -n "${PICTURE_PROFILE:-}" ]; then     # a third process under cProfile: where its host time goes
              $limit python3 scripts/gpu_picture.py "$model" --out "$OUT/picture_profiled.json" --sizes 512 --steps 2 \
                --host-profile "$OUT/picture_profile.txt" 2>&1 | tee -a "$OUT/picture.txt"
            fi
            for round in $(seq 1 "${PICTURE_AB_ROUNDS:-2}"); do     # uploaders in turn: an A/B of the start-up
              for how in ${PICTURE_AB:-}; do
                echo "== uploader $how, round $round" | tee -a "$OUT/picture.txt"
                $limit python3 scripts/gpu_picture.py "$model" --out "$OUT/picture_ab-$how-$round.json" --sizes 512 \
                  --steps 4 --uploader "$how" 2>&1 | tee -a "$OUT/picture.txt"
              done
            done
            if [ -n "${PICTURE_COLD:-}" ]; then        # then one on a cold page cache: the folder's files evicted first
              $limit python3 scripts/gpu_load.py "$model" --evict 2>&1 | tee -a "$OUT/picture.txt"
              $limit python3 scripts/gpu_picture.py "$model" --out "$OUT/picture_cold.json" --sizes 512 --steps 4 2>&1 \
                | tee -a "$OUT/picture.txt"
            fi
          fi ;;
    same) $limit python3 scripts/gpu_same_artifacts.py --trees "${SAME_TREE:-before}" . --out "$OUT/same.json" 2>&1 \
            | tee "$OUT/same.txt" ;;
    tables) python3 scripts/bench_tables.py "$OUT" --out "$OUT/tables.md" ;;
    *) echo "unknown step $step"; false ;;
  esac
  rc=$?
  [ $rc -ne 0 ] && status=$rc
  [ "$step" = contract ] && [ $rc -eq 0 ] && contract_ok=1
  echo "== $step rc=$rc $(( $(date +%s) - start )) s" | tee -a "$OUT/steps.txt"
  pack || status=1
done
exit $status
