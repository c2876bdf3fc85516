"""Outside reference: HF transformers `generate` (static cache) throughput on the same GPU.

Random bf16 Llama-3-8B-shaped weights, fixed input/output lengths, batches of `--batch`
requests generated with a static KV cache; throughput counted as NanoFlow does (prompt + output
tokens over wall time). Run beside `nanosched bench` on the same machine and compare the ratio.

    PYTHONPATH=. python bench/engine/hf_reference.py --layers 32 --input-len 1024 --output-len 512 \
        --batch 64 --batches 2
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--batches", type=int, default=2)
    args = ap.parse_args()

    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=args.layers,
                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                      max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    gen_kw = {"max_new_tokens": args.output_len, "min_new_tokens": args.output_len,
              "do_sample": False, "cache_implementation": "static", "pad_token_id": 0}
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.input_len), device="cuda")
    with torch.inference_mode():
        model.generate(ids[:, :32], **{**gen_kw, "max_new_tokens": 8, "min_new_tokens": 8})
        torch.cuda.synchronize()
        start = time.perf_counter()
        for b in range(args.batches):
            ids = torch.randint(0, cfg.vocab_size, (args.batch, args.input_len), device="cuda",
                                generator=torch.Generator("cuda").manual_seed(b))
            out = model.generate(ids, **gen_kw)
            assert out.shape[1] == args.input_len + args.output_len
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
    tokens = args.batches * args.batch * (args.input_len + args.output_len)
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "transformers": transformers.__version__, "args": vars(args),
              "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed}
    text = json.dumps(result, indent=1)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "hf_reference.json"), "w") as f:
            f.write(text)
    print(text)
    print(f"HF generate: {tokens / elapsed:.0f} tokens/s ({args.layers} layers)")


if __name__ == "__main__":
    main()
