"""Input builders shared by the kernel tests (imported as a plain module via conftest's directory)."""
import torch

D_FF, D_MODEL = 200, 72  # odd, non-multiple-of-block sizes


def rnd(shape, gen, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def make_idx(gen, n, s, mode, device, idx_dtype=torch.int32):
    """Active set of round((1-s)*n) distinct rows. mode 'fixed': idx of exactly K, count None.
    mode 'padded': a longer buffer whose tail is out-of-range junk (must never be read) + count."""
    k = int(round((1 - s) * n))
    perm = torch.randperm(n, generator=gen)
    if mode == "fixed":
        return perm[:k].to(idx_dtype).to(device), None
    pad = 13
    idx = torch.cat([perm[:k], torch.full((pad,), 10**6 + 7)]).to(idx_dtype).to(device)
    return idx, torch.tensor([k], dtype=torch.int32, device=device)


def ffn_weights(gen, dtype, device, d=D_MODEL, n=D_FF):
    wg = rnd((n, d), gen, dtype, device, d**-0.5)
    wu = rnd((n, d), gen, dtype, device, d**-0.5)
    wdt = rnd((n, d), gen, dtype, device, n**-0.5)
    return wg, wu, wdt


def up(t):
    return None if t is None else (t.double() if t.is_floating_point() else t)
