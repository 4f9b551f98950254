"""Run under torchrun: ring_all_reduce against dist.all_reduce over sizes, shapes and dtypes.

Each case checks (a) equality with the library (exact for integers and integer-valued floats, close for
random floats), (b) bit-identical results on every rank, (c) the reduction happened in place.
"""

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import identical_across_ranks, load_script  # noqa: E402

ring_all_reduce = load_script("03_all_reduce.py").ring_all_reduce

TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    numels = [1, 2, world - 1, world, world + 1, 7, 1000, (1 << 16) + 3]
    shapes = [()] + [(n,) for n in numels if n > 0] + [(3, 5, 7), (64, 33)]
    dtypes = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64, torch.uint8]
    cases = 0
    for dtype in dtypes:
        for shape in shapes:
            for transpose in ([False, True] if len(shape) == 2 else [False]):
                g = torch.Generator().manual_seed(1000 * rank + cases)
                if dtype.is_floating_point:
                    kinds = {"int-valued": torch.randint(-8, 8, shape, generator=g).to(dtype),
                             "random": torch.randn(shape, generator=g, dtype=torch.float32).to(dtype)}
                else:
                    hi = 4 if dtype == torch.uint8 else 1000
                    kinds = {"int": torch.randint(0, hi, shape, generator=g).to(dtype)}
                for kind, x in kinds.items():
                    if transpose:
                        x = x.t()  # non-contiguous input: the result must still land in x itself
                    lib = x.clone()
                    dist.all_reduce(lib)
                    out = ring_all_reduce(x)
                    where = f"shape={shape} T={transpose} {dtype} {kind}"
                    assert out is x, where
                    if kind == "random":
                        assert torch.allclose(x.double(), lib.double(), rtol=TOL[dtype], atol=TOL[dtype] * world), where
                    else:
                        assert torch.equal(x, lib), where
                    assert identical_across_ranks([x]), f"ranks differ: {where}"
                    cases += 1
    empty = torch.empty(0)
    assert ring_all_reduce(empty).numel() == 0
    dist.barrier()
    if rank == 0:
        print(f"OK ring_all_reduce == dist.all_reduce in {cases} cases on {world} ranks", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
