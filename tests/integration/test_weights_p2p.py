"""P2P sync with two real FSDP2 trainer processes (gloo): each rank sends only the parameters it owns.

The engine runs in this process so its weights can be compared; the two
ranks are separate processes that shard the model with FSDP2, gather the
shards of their own parameters and post them to the engine concurrently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from transformers import AutoModelForCausalLM

from furlong.core.net import free_port
from furlong.engine.engine import Engine
from furlong.engine.quantized import held_state_dict
from furlong.engine.server import ServerThread
from furlong.models import create_model
from furlong.weights.tensors import checksum

TOKEN = "adm"

WORKER = r"""
import json, os, sys
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM
from furlong.train.dist import init, shard
from furlong.weights.factory import make_sender

rank, world, url, model, token = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5]
device = init(rank, world, "gloo")
net = shard(AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32), device)
sd = net.state_dict()
assert all(type(t).__name__ == "DTensor" for t in sd.values())
sender = make_sender("p2p", bucket_mb=0.05, verify=True)
sender.connect([url], token)
report = sender.push(sd.items(), 7)
sender.close()
print("REPORT " + json.dumps({"rank": rank, "tensors": report.tensors, "bytes": report.bytes, "buckets": report.buckets, "verified": report.verified}))
dist.destroy_process_group()
"""


def test_two_fsdp_ranks_each_send_their_own_part():
    old, new = create_model("qwen3", "tiny"), create_model("qwen3", "tiny", seed=1)
    new_sd = AutoModelForCausalLM.from_pretrained(new).state_dict()
    engine = Engine(old, kv_cache_mb=1).start()
    try:
        with ServerThread(engine, admin_token=TOKEN) as srv:
            env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", WORKER, str(r), "2", srv.url, str(new), TOKEN],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for r in range(2)
            ]
            outs = []
            for p in procs:
                out, err = p.communicate(timeout=180)
                assert p.returncode == 0, err[-3000:]
                outs.append(json.loads(next(line for line in out.splitlines() if line.startswith("REPORT "))[7:]))
        held = engine.call(lambda: held_state_dict(engine.hf, engine.model)).result(60)
        sums = {n: checksum(t) for n, t in held.items()}
        assert sums == {n: checksum(t) for n, t in new_sd.items()}
        assert engine.weight_version == 7 and all(o["verified"] for o in outs)
        total = sum(t.numel() * 4 for t in new_sd.values())
        # Each rank sent a disjoint, non-empty part; together exactly the model, about half each.
        assert sum(o["tensors"] for o in outs) == len(new_sd) and all(o["tensors"] > 0 for o in outs)
        assert sum(o["bytes"] for o in outs) == total and all(o["bytes"] < 0.75 * total for o in outs)
        assert engine.stats["weight_updates_total"] == sum(o["buckets"] for o in outs)
    finally:
        engine.stop()
