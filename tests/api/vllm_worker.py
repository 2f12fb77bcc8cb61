"""One vLLM engine in a fresh process, as a user starts it: ``python vllm_worker.py CHECKPOINT
LOAD_FORMAT OUT.json [EXTRA_CONFIG_JSON]``. Writes the greedy continuations of fixed prompts
and a digest of every parameter of the model the engine built, and (load format ``gdskit``)
the loader's placement report, asked of the engine's worker process. gdskit is not imported
in this process: vLLM finds the ``gdskit`` load format through the installed entry point, in
its own engine process."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import sys

PROMPTS = [[1, 5, 9, 14, 3], [7, 7, 2], [100, 200, 300, 400]]


def digests(model):
    import torch

    out = {}
    for name, p in model.named_parameters():
        raw = p.detach().contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes()
        out[name] = [list(p.shape), str(p.dtype), hashlib.sha256(raw).hexdigest()]
    return out


def placement_report(model):
    """The gdskit loader's report in the engine's worker process (None under other load formats)."""
    import gdskit.vllm
    report = gdskit.vllm.last_report()
    return None if report is None else dataclasses.asdict(report)


def main() -> None:
    from vllm import LLM, SamplingParams

    path, load_format, out = sys.argv[1], sys.argv[2], sys.argv[3]
    extra = {"model_loader_extra_config": json.loads(sys.argv[4])} if len(sys.argv) > 4 else {}
    llm = LLM(model=path, load_format=load_format, **extra, skip_tokenizer_init=True,
              enforce_eager=True, gpu_memory_utilization=0.1, max_model_len=64, max_num_seqs=4, dtype="bfloat16",
              seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=12, detokenize=False)
    results = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    tokens = [list(r.outputs[0].token_ids) for r in results]
    weights = llm.apply_model(digests)[0]
    report = llm.apply_model(placement_report)[0] if load_format == "gdskit" else None
    with open(out, "w") as f:
        json.dump({"tokens": tokens, "weights": weights, "report": report}, f)


if __name__ == "__main__":
    main()
