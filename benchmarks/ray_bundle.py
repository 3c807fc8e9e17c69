"""Ray for the GPU machine, which has no Ray and no package index: wheels packed here, unpacked there.

    python benchmarks/ray_bundle.py pack      # here (has PyPI): .ray/p0, .ray/p1 (< 64 MiB each, git-excluded)
    python benchmarks/ray_bundle.py unpack    # there: /tmp/raysite (reads /tmp/ray_p0 or .ray/p0, and .ray/p1)

A device call carries at most 64 MiB and Ray's wheel alone is ~79 MB, so it travels in two calls while the
machine stays warm: call 1 carries .ray/p0 and copies it to /tmp/ray_p0; call 2 carries .ray/p1 (and
unpacks). The GPU image runs Python 3.12; the wheels are chosen for it. Unpacking needs no pip: wheels are
zip files, extracted with their exec bits (Ray's raylet and GCS binaries). benchmarks/gpu_multi.py puts
/tmp/raysite at the end of PYTHONPATH (the machine's own packages come first).
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
import tarfile
import zipfile

RAY = "ray==2.60.0"
SITE = "/tmp/raysite"
PIECE = 60 << 20


def pack(folder: str = ".ray") -> None:
    wheels = os.path.join(folder, "wheels")
    os.makedirs(wheels, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", RAY, "--python-version", "3.12", "--only-binary=:all:",
                    "--platform", "manylinux2014_x86_64", "-d", wheels, "-q"], check=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name in sorted(os.listdir(wheels)):
            tar.add(os.path.join(wheels, name), arcname=name)
    data = buf.getvalue()
    for i in range(0, len(data), PIECE):
        with open(os.path.join(folder, f"p{i // PIECE}"), "wb") as f:
            f.write(data[i:i + PIECE])
    print(f"{len(data) >> 20} MiB in {-(-len(data) // PIECE)} pieces under {folder}/")


def unpack(folder: str = ".ray") -> str | None:
    """Ray importable from SITE after this; returns SITE, or None when pieces are missing."""
    if os.path.isdir(os.path.join(SITE, "ray")):
        return SITE
    parts = [p for p in ("/tmp/ray_p0" if os.path.exists("/tmp/ray_p0") else os.path.join(folder, "p0"),
                         os.path.join(folder, "p1")) if os.path.exists(p)]
    if len(parts) < 2:
        return None
    data = b"".join(open(p, "rb").read() for p in parts)
    tmp = SITE + ".tmp"
    os.makedirs(tmp, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        for member in tar.getmembers():
            with zipfile.ZipFile(tar.extractfile(member)) as whl:
                for info in whl.infolist():
                    path = whl.extract(info, tmp)
                    mode = info.external_attr >> 16
                    if mode & 0o111:
                        os.chmod(path, mode & 0o777)
    os.rename(tmp, SITE)
    return SITE


if __name__ == "__main__":
    what = sys.argv[1] if len(sys.argv) > 1 else ""
    if what == "pack":
        pack()
    elif what == "unpack":
        print(unpack() or "missing a piece: need /tmp/ray_p0 (or .ray/p0) and .ray/p1")
    else:
        sys.exit("usage: ray_bundle.py pack|unpack")
