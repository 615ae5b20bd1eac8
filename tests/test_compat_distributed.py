"""flash_attn.utils.distributed (the compatibility package's): the collectives and their gradients at world size 2,
two CPU processes over gloo, against the sums written out."""

from __future__ import annotations

import datetime
import json

import pytest
import torch
import torch.distributed as dist

WORLD = 2


def _worker(rank: int, store_path: str, out_dir: str) -> None:
    store = dist.FileStore(store_path, WORLD)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=WORLD, timeout=datetime.timedelta(minutes=1))
    from flash_attn.utils.distributed import all_gather, all_reduce, get_dim_for_local_rank, reduce_scatter

    x = torch.full((2, 3), float(rank + 1), dtype=torch.float64, requires_grad=True)
    gathered = all_gather(x, None)  # (4, 3): rank 0's rows, then rank 1's
    gathered.backward(torch.full_like(gathered, float(rank + 1)))  # gradient: the sum of the ranks' rows
    y = (torch.arange(4, dtype=torch.float64) * (rank + 1)).repeat(3, 1).t().contiguous().requires_grad_()
    scattered = reduce_scatter(y, None)  # (2, 3): this rank's rows of the sum over ranks
    scattered.backward(torch.ones_like(scattered) * (rank + 1))  # gradient: the all-gather of the ranks' gradients
    summed = all_reduce(torch.full((3,), float(rank + 1), dtype=torch.float64), None)
    result = {
        "gathered": gathered[:, 0].tolist(),
        "x_grad": x.grad[:, 0].tolist(),
        "scattered": scattered[:, 0].tolist(),
        "y_grad": y.grad[:, 0].tolist(),
        "summed": summed.tolist(),
        "dims": [get_dim_for_local_rank(10, 3, r, multiple_of=2) for r in range(3)],
    }
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def test_collectives_and_their_gradients(flash_attn_compat, tmp_path):
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    torch.multiprocessing.spawn(_worker, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=WORLD)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    for rank, got in enumerate(ranks):
        assert got["gathered"] == [1.0, 1.0, 2.0, 2.0]
        assert got["x_grad"] == [3.0, 3.0]  # 1 + 2 from the two ranks' gradients
        assert got["scattered"] == [3.0 * v for v in ([0.0, 1.0] if rank == 0 else [2.0, 3.0])]
        assert got["y_grad"] == [1.0, 1.0, 2.0, 2.0]
        assert got["summed"] == [3.0, 3.0, 3.0]
        assert got["dims"] == [4, 4, 2]  # 5 pairs among 3 ranks: 2, 2, 1
