"""Which rows of a 256 x 151,936 temperature batch differ between the fast sampler and the reference (GPU)."""
import torch

from infer.sampling import SamplingParams
from infer.sampling.sampler import SamplingTensors, random_uniform, sample, sample_reference

vocab, b = 151_936, 256
g = torch.Generator(device="cuda").manual_seed(6)
logits = (torch.randn(b, vocab, generator=g, device="cuda") * 3)
params = [SamplingParams(temperature=0.8)] * b
outputs = [list(range(i, i + 32)) for i in range(b)]
t = SamplingTensors.from_params(params, list(range(b)), [7] * b, outputs, outputs, None, vocab, "cuda")
want = sample_reference(logits, t)
got = sample(logits, t)
mm = (got.next_tokens != want.next_tokens).nonzero().flatten().tolist()
print("mismatch rows", mm)
for r in mm:
    x = logits[r:r+1].double() / 0.8
    p = torch.softmax(x, -1)
    u = random_uniform(t.seeds[r:r+1], t.steps[r:r+1], vocab).double()
    score = p / (-torch.log(u))
    top = score.topk(3)
    gv, wv = got.next_tokens[r].item(), want.next_tokens[r].item()
    print("row", r, "got", gv, "want", wv, "float64 top3", top.indices.tolist(), top.values.tolist(),
          "rel gap", ((top.values[0, 0] - top.values[0, 1]) / top.values[0, 0]).item(),
          "u at got/want", u[0, gv].item(), u[0, wv].item())
