"""Run 26 call 3: the best one-row tiles of Qwen3-4B's fused norm + QKV and norm + gate/up + SiLU per one-load
threshold (tune_<threshold>.json from skinny_gemm.py --tune --fused --pdl); prints the env of the best pair."""
import json
import sys

best = None
for one in sys.argv[1:]:
    rows = {r["proj"]: r for r in json.load(open(f"/tmp/logs/tune_{one}.json"))["results"]}
    q, g = rows["norm+qkv"], rows["norm+gate_up+act"]
    for r in (q, g):
        print(f"one-load <= {one}/thread {r['proj']}: default {r['default_tile']} {r.get('skinny_pdl_us')} us; "
              f"best {list(r['tiles'].items())[:6]}", file=sys.stderr)
    total = q["best_us"] + g["best_us"]
    if best is None or total < best[0]:
        best = (total, one, q["best_tile"], g["best_tile"])
_, one, qt, gt = best
print(f"INFER_EXP_ONE_LOAD={one} INFER_EXP_TILE_NORM_PLAIN_2560={','.join(map(str, qt))} "
      f"INFER_EXP_TILE_NORM_ACT_2560={','.join(map(str, gt))}")
