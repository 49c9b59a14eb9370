"""Sync through safetensors files: the transport that needs nothing but a shared filesystem.

Each sync writes `<directory>/v<version>/model-0000k-of-0000n.safetensors`
(one file per bucket) into a temporary folder renamed into place when
complete, so an engine never reads a half-written version; then every engine
loads the folder in one `/update_weights_from_disk` request, which is atomic
on the engine and carries the version. The newest `keep` versions stay on
disk (a replaced engine can load the latest one itself).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from furlong.core.client import EngineControl
from furlong.weights.base import Sender, buckets, nbytes
from furlong.weights.report import SyncReport


class DiskSender(Sender):
    transport = "disk"

    def __init__(self, directory: str | Path, bucket_mb: float = 1024, keep: int = 2, **kw):
        super().__init__(bucket_mb=bucket_mb, **kw)
        if keep < 1:
            raise ValueError(f"keep: must be at least 1, got {keep}")
        self.directory, self.keep = Path(directory), keep

    def _send(self, items: list[tuple[str, torch.Tensor]], report: SyncReport) -> None:
        from safetensors.torch import save_file

        dest = self.directory / f"v{report.version}"
        tmp = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        groups = buckets(items, self.bucket_bytes)
        seen: set[int] = set()
        for k, group in enumerate(groups):
            files = {}
            for name, t in group:
                t = t.detach().cpu().contiguous()
                # safetensors refuses tensors sharing storage (tied weights): give repeats their own copy
                ptr = t.untyped_storage().data_ptr()
                files[name] = t.clone() if ptr in seen else t
                seen.add(ptr)
            save_file(files, str(tmp / f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"))
            report.buckets += 1
            report.tensors += len(group)
            report.bytes += sum(nbytes(t) for _, t in group)
        shutil.rmtree(dest, ignore_errors=True)
        tmp.rename(dest)
        self._wait(self._post_all(EngineControl.update_weights_from_disk, True, model_path=str(dest)))
        self._prune()

    def _prune(self) -> None:
        versions = sorted(
            (int(p.name[1:]), p) for p in self.directory.glob("v*") if p.is_dir() and p.name[1:].isdigit()
        )
        for _, p in versions[: -self.keep]:
            shutil.rmtree(p, ignore_errors=True)
