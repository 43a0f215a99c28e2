"""The demo's embedded object store: a synthetic image dataset in the loopback object store.

``asyncload demo`` runs this file as a *script* in a child process (``python demo_server.py``),
not through the package: the child then imports NumPy, the ``loopback`` package and the
aiohttp.web it serves over, not asyncload (and torch); it starts in about a quarter of a second,
and its request handling never competes for the GIL with the training loop whose data wait the
demo measures. The child prints ``PORT <n>`` and serves until its stdin closes, so it also goes
away when the parent dies (``loopback.run_child``).

The dataset is CIFAR-10's binary record layout, one record per object: one label byte, then
3×32×32 ``uint8`` pixels (all red, then green, then blue), 3,073 bytes. Record *i* depends only
on ``(seed, i)``; each class has its own mean colour, so a small model learns it in a few steps.
Objects are served as ``/<prefix>/<i:05d>.bin`` with ``/<prefix>/manifest.txt`` listing them,
since plain HTTP has no way to list a prefix.
"""

from __future__ import annotations

import argparse

import numpy as np

try:
    from . import loopback
except ImportError:  # run as a script (see above): this folder is sys.path[0], no package,
    # so cli/loopback/ is imported as the top-level package ``loopback``.
    import loopback  # type: ignore[no-redef,import-not-found]

RECORD_SIZE = 1 + 3 * 32 * 32
NUM_CLASSES = 10
PREFIX = "cifar"
MANIFEST = "manifest.txt"


def make_record(index: int, seed: int) -> bytes:
    """Record *index* of the synthetic dataset: a label byte and 3×32×32 pixels."""
    rng = np.random.default_rng([seed, index])
    label = int(rng.integers(NUM_CLASSES))
    # Distinct, fixed mean colours per class; noise makes it a (small) learning problem.
    mean = np.array([(label * 73) % 256, (label * 151 + 60) % 256, (label * 199 + 120) % 256])
    pixels = mean[:, None, None] + rng.normal(0.0, 48.0, size=(3, 32, 32))
    return bytes([label]) + np.clip(pixels, 0, 255).astype(np.uint8).tobytes()


def object_name(index: int) -> str:
    return f"{index:05d}.bin"


def make_objects(count: int, seed: int) -> dict[str, bytes]:
    """Every object the store serves, keyed by path (the manifest included)."""
    objects = {f"{PREFIX}/{object_name(i)}": make_record(i, seed) for i in range(count)}
    manifest = "".join(f"{object_name(i)}\n" for i in range(count)).encode()
    objects[f"{PREFIX}/{MANIFEST}"] = manifest
    return objects


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--objects", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--latency", type=float, default=0.05)
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args(argv)
    objects = make_objects(args.objects, args.seed)
    loopback.run_child(
        loopback.Store(port=args.port, objects=objects, latency=args.latency, record=False)
    )


if __name__ == "__main__":
    main()
