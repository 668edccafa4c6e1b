#!/bin/bash
# GPU run 34, call 5: call 4's static merge (M) with x's next slice loaded ahead per projection
# (call5_experiment.patch; INFER_EXP_X_AHEAD lists the tiles that load it ahead, INFER_EXP_TILES overrides a
# one-row tile "n,k,act,norm=BLOCK_N,BLOCK_K,warps,stages"). Qwen3-4B: A = HEAD; M; MQ = M + x ahead in QKV's
# (8, 256, 8); MO = in o's (2, 1024, 4); MD = in down's persistent (2, 2048, 8); MQ2 = QKV at (2, 512, 2) with x
# ahead; MO2 = o at (2, 512, 2) with x ahead. Alternated twice. Qwen3-0.6B (every projection (2, 512, 2)): A, MX.
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
nvidia-smi --query-gpu=name --format=csv,noheader; T0=$(date +%s)
CK=/tmp/infer-ckpt L=/tmp/logs; mkdir -p $L
for p in qwen3-4b qwen3-0.6b; do [ -d $CK/$p ] || PYTHONPATH=$PWD/src python3 scripts/make_synthetic_checkpoint.py $p $CK/$p --device cuda >/dev/null 2>&1; done
ALL=batching=continuous,kv_cache=paged,fused_kernels=true,cuda_graphs=true,async_scheduling=true,pdl=true
src() { [ $1 = A ] && echo $PWD/.base/src || echo $PWD/src; }
xa() { case $1 in MQ) echo "8,256,8";; MO) echo "2,1024,4";; MD) echo "2,2048,8";; MQ2|MO2) echo "2,512,2";; MX) echo 1;; esac; }
tiles() { case $1 in MQ2) echo "6144,2560,0,1=2,512,2,0";; MO2) echo "2560,4096,0,0=2,512,2,0";; esac; }
run() { INFER_EXP_STATIC_MERGE=$([ $2 = A ] && echo 0 || echo 1) INFER_EXP_X_AHEAD=$(xa $2) INFER_EXP_TILES=$(tiles $2) \
  PYTHONPATH=$(src $2) timeout 75 python3 benchmarks/single_stream.py --model $CK/$1 \
  --device cuda --dtype bfloat16 --prompt-lens 128 --output-len 128 --repeats 3 --hf --infer-configs "$ALL" --out $L/ss.json \
  > $L/ss.log 2>&1 || tail -3 $L/ss.log
  echo "$1 $2 batch 1 (+$(( $(date +%s) - T0 )) s): $(grep -E '^\| infer' $L/ss.md | cut -d'|' -f4-8)"; }
for i in 1 2; do for v in A M MQ MO MD MQ2 MO2; do run qwen3-4b $v; done; done
for v in A MX A MX; do run qwen3-0.6b $v; done
echo "wall $(( $(date +%s) - T0 )) s"
