"""User attributes of odd dtypes/shapes carried through migrations (PencilDecomposition.migrate)."""
import sys, torch, torch.distributed as dist
from common import *
from torchpm.distributed import process_grid_groups, PencilDecomposition

rank, world = init()
grid = tuple(int(v) for v in sys.argv[1].split("x"))
mesh = PencilDecomposition((9, 7, 5), process_grid_groups(grid))
shape = torch.tensor(mesh.global_shape, dtype=torch.float64)

def attrs_of(ids, kinds):
    f = ids.to(torch.float64)
    out = []
    for k in kinds:
        if k == "f32": out.append((f * 0.5 + 1).to(torch.float32).unsqueeze(-1))
        if k == "f16": out.append((f % 100).to(torch.float16).unsqueeze(-1))
        if k == "bf16": out.append((f % 50).to(torch.bfloat16).unsqueeze(-1))
        if k == "i32": out.append((ids * 3 + 7).to(torch.int32))
        if k == "i64": out.append(ids * 1_000_003 + 2**45)
        if k == "i16": out.append((ids % 30000).to(torch.int16).unsqueeze(-1))
        if k == "u8": out.append((ids % 256).to(torch.uint8).unsqueeze(-1))
        if k == "bool": out.append((ids % 3 == 0))
        if k == "f64_2x2": out.append(f.view(*f.shape, 1, 1).expand(*f.shape, 2, 2).clone() * torch.tensor([[1.0, 2.0], [3.0, 4.0]], dtype=torch.float64))
        if k == "c64": out.append((f + 1j * f).to(torch.complex64).unsqueeze(-1))
        if k == "nan_payload": out.append(torch.where(ids % 2 == 0, torch.full_like(f, float("nan")), f).unsqueeze(-1))
    return out

KINDS = [["f32"], ["f16"], ["bf16"], ["i32"], ["i64"], ["i16"], ["u8"], ["bool"], ["f64_2x2"], ["c64"], ["nan_payload"],
         ["f32", "i32", "bool", "i64", "f16", "f64_2x2"]]
for pdtype in (torch.float64, torch.float32):
    for kinds in KINDS:
        label = f"grid={grid} positions {pdtype} attrs {kinds}"
        g = torch.Generator().manual_seed(rank + 10)
        per = 15
        ids = (torch.arange(per) + rank * per).repeat(2, 1); ids[1] += 500
        x = (torch.rand(2, per, 3, generator=g, dtype=torch.float64) * shape).to(pdtype)
        ok = True; msg = ""
        try:
            for rnd in range(6):
                a = attrs_of(ids, kinds)
                if rnd == 0:
                    pass
                if rnd % 3 == 2:
                    x = (x.double() + (torch.rand(x.shape, generator=g, dtype=torch.float64) - 0.5) * 3 * shape).to(pdtype)
                else:
                    x = (x.double() + (torch.rand(x.shape, generator=g, dtype=torch.float64) - 0.5) * 2).to(pdtype)
                x = torch.where((ids >= 0).unsqueeze(-1), x, torch.zeros_like(x))
                plan, x, ids, *moved = mesh.migrate(x, ids, *a, overwrite=(rnd % 2 == 1))
                valid = ids >= 0
                exp = attrs_of(ids.clamp(min=0), kinds)
                for k, m, e in zip(kinds, moved, exp):
                    if m.dtype != e.dtype or m.shape != e.shape:
                        ok = False; msg += f" {k}: dtype/shape {m.dtype}{tuple(m.shape)} vs {e.dtype}{tuple(e.shape)}"; continue
                    mv, ev = m[valid], e[valid]
                    same = torch.equal(mv, ev) if k != "nan_payload" else torch.equal(torch.isnan(mv), torch.isnan(ev)) and torch.equal(mv[~torch.isnan(mv)], ev[~torch.isnan(ev)])
                    if not same:
                        ok = False; msg += f" {k}: values differ (round {rnd})"
            cnt = torch.tensor([int(valid.sum())]); dist.all_reduce(cnt)
            allids = [None] * world; dist.all_gather_object(allids, ids[ids >= 0].tolist())
            flat = sorted(i for p in allids for i in p)
            if int(cnt) != 2 * per * world or len(set(flat)) != len(flat): ok = False; msg += f" count {int(cnt)}"
        except Exception as e:
            ok = False; msg = f"RAISED {type(e).__name__}: {' '.join(str(e).split())[:250]}"
        flags = [None] * world; dist.all_gather_object(flags, (ok, msg))
        if rank == 0:
            bad = [(r, m) for r, (o, m) in enumerate(flags) if not o]
            print(f"{label}: {'OK' if not bad else 'FAIL ' + str(bad[:2])}", flush=True)
dist.destroy_process_group()
