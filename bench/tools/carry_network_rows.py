"""A profile's network side carried into a newer profile of the same model, tp and GPU type.

    PYTHONPATH=. python bench/tools/carry_network_rows.py NEW.json OLD.json OUT.json

Use: a tp > 1 profile whose compute and memory rows were re-measured on one GPU (where the
network rows can only be modelled from the GPU's prior link bandwidth) takes its network rows,
GEMM x collective pairs, network R->P tables and all-reduce ceilings from an older profile of
the same model, tp and GPU type that measured them on several GPUs. The kernel rows and the
compute x memory pairs stay the new profile's; the notes say what was carried and from when.
"""

from __future__ import annotations

import argparse
from dataclasses import replace

from nanosched.errors import ProfileError
from nanosched.profiler.format import Profile, load_profile, save_profile

NETWORK_OPS = ("ar_attn", "ar_ffn", "rs_attn", "rs_ffn", "ag_attn", "ag_ffn")


def carry(new: Profile, old: Profile) -> Profile:
    same = (new.model == old.model, new.tp == old.tp,
            new.identity.gpu_name == old.identity.gpu_name)
    if not all(same):
        raise ProfileError("profiles differ in model, tp or GPU: nothing can be carried")
    kernels = tuple(k for k in new.kernels if k.op not in NETWORK_OPS) + tuple(
        k for k in old.kernels if k.op in NETWORK_OPS)
    pairs = tuple(p for p in new.pairs if p.other_class != "network") + tuple(
        p for p in old.pairs if p.other_class == "network")
    rp = {c: pts for c, pts in new.rp.items() if c != "network"}
    rp_shapes = {c: pts for c, pts in new.rp_shapes.items() if c != "network"}
    if "network" in old.rp:
        rp["network"] = old.rp["network"]
    if "network" in old.rp_shapes:
        rp_shapes["network"] = old.rp_shapes["network"]
    c = old.ceilings
    ceilings = replace(new.ceilings, allreduce_busbw_gbs=c.allreduce_busbw_gbs,
                       allreduce_latency_us=c.allreduce_latency_us,
                       allreduce_modelled=c.allreduce_modelled)
    kept = [n for n in new.notes if "network" not in n and "link bandwidth" not in n]
    carried = [n for n in old.notes if "network" in n]
    notes = (*kept, *carried,
             f"network rows, GEMM x collective pairs, network R->P tables and all-reduce "
             f"ceilings carried from the profile of {old.identity.date} ({old.identity.command})")
    return replace(new, kernels=kernels, pairs=pairs, rp=rp, rp_shapes=rp_shapes,
                   ceilings=ceilings, notes=notes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("new")
    ap.add_argument("old")
    ap.add_argument("out")
    args = ap.parse_args()
    prof = carry(load_profile(args.new), load_profile(args.old))
    save_profile(prof, args.out)
    print(f"wrote {args.out}: {len(prof.kernels)} kernel rows, {len(prof.pairs)} pairs")


if __name__ == "__main__":
    main()
