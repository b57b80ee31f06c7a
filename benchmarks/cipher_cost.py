"""What transfer.encrypt_writes ("chacha20", the default) costs, beside the copies it
replaces and the wire time of the block.

A staging block is encrypted once and decrypted once on its path (hw/rank/cipher.py):
the writer encrypts it into its send buffer (on host memory that pass replaces the copy
of its private block into the slot; on a GPU it is one more pass over the slot, in
place), and the decode decrypts each writer block out of the ring into a private copy
(replacing the copy it makes for the write tag on host memory; on a GPU one more pass
before the scatter, which then reads the private copy). For each block size, best of
`--reps`, on `--device` (cpu: `cryptography`'s ChaCha20; cuda: the Triton kernel,
hw/rank/chacha_kernel.py; cuda adds 64 and 256 MiB blocks):

- copy_s: a plain copy of the block (torch copy_), the baseline of the same run;
- seal_s: the block encrypted into another buffer (`xor_keystream`); GB/s its rate;
- x_copy: seal_s / copy_s;
- model_s: the block's time on the wire of the default profile, rdma-400g (370 Gb/s,
  scenarios/profiles/rdma-400g.toml inter_bandwidth_gbps);
- host /model: what the cipher adds to a block's path on host memory, 2 * (seal_s -
  copy_s) (each pass replaces a copy), over model_s;
- gpu /model: the same on a GPU, 2 * seal_s (each pass is added), over model_s.
  The bar for the write tag is <= 5% (issue 39); the cipher is measured against it too.

Run on a quiet host; `uptime` is printed with the figures.

    .venv/bin/python benchmarks/cipher_cost.py
    python3 benchmarks/cipher_cost.py --device cuda
"""

from __future__ import annotations

import argparse
import subprocess

import torch
from checksum_cost import RDMA_400G_BPS, SIZES, best_wall  # benchmarks/

from kvstage.hw.rank.cipher import cipher_key, warm_device_cipher, xor_keystream


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cpu", help="where the block lives: cpu or cuda")
    args = ap.parse_args()
    print(subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    cuda = torch.device(args.device).type == "cuda"
    sizes = SIZES + ([64 << 20, 256 << 20] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    warm_device_cipher(args.device)
    key = cipher_key(bytes(32))
    print(
        f"{'block':>9} {'copy_s':>9} {'seal_s':>9} {'GB/s':>7} {'x_copy':>6} {'model_s':>9} "
        f"{'host /model':>11} {'gpu /model':>10}"
    )
    for n in sizes:
        data = torch.randint(0, 256, (n,), dtype=torch.uint8, device=args.device)
        dst = torch.empty_like(data)
        xor_keystream(key, 1, 2, 3, data, dst)  # warm-up (a GPU's compile)
        sync()

        def copy(data=data, dst=dst) -> None:
            dst.copy_(data)
            sync()

        def seal(data=data, dst=dst) -> None:
            xor_keystream(key, 1, 2, 3, data, dst)
            sync()

        c = best_wall(copy, args.reps)
        e = best_wall(seal, args.reps)
        m = n / RDMA_400G_BPS
        print(
            f"{n >> 10:>7}Ki {c:>9.6f} {e:>9.6f} {n / e / 1e9:>7.2f} {e / c:>6.1f} {m:>9.6f} "
            f"{2 * (e - c) / m:>11.1%} {2 * e / m:>10.1%}"
        )


if __name__ == "__main__":
    main()
