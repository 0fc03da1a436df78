"""Resume W/killed (restored by hard links, state files copied) with the tree at PYTHONPATH: its measured() row.

    TREE=<name> PYTHONPATH=<tree> python resume_ab.py W   # one JSON line: peak_mib (VmHWM), first_prompt_s, s
"""
import json, os, shutil, subprocess, sys
from pathlib import Path
from bench.scale_out import measured
from bench.common import FAKE
w = Path(sys.argv[1])
out = w / "out"
shutil.rmtree(out, ignore_errors=True)
subprocess.run(["cp", "-al", str(w / "killed"), str(out)], check=True)
st = out / "_batchjson"
for p in os.listdir(st):
    if p not in ("units", "requeue"):
        q = st / p
        shutil.rmtree(q) if q.is_dir() else q.unlink()
        subprocess.run(["cp", "-a", str(w / "killed" / "_batchjson" / p), str(q)], check=True)
env = os.environ | {FAKE: str(w / "model")}
load = os.getloadavg()[0]
r = measured(["run", str(w / "job.toml"), "--replicas", "2"], env, w)
rep = json.loads((out / "_report.json").read_text())
print(json.dumps({"tree": os.environ.get("TREE"), "load": round(load, 2), **r, "check": rep.get("verified", {}).get("ok"),
                  "summary": [l for l in (w / "run.log").read_text().splitlines() if "exactly-once" in l]}), flush=True)
