"""Make W/killed: a fresh run of W/job.toml killed at SHARE of its rows (bench.scale_out.measured), kept by hard links.

    PYTHONPATH=<tree> python mk_killed.py W SHARE ROWS   # W: bench.scale_out's folder (job.toml, model, inputs)
"""
import json, os, shutil, subprocess, sys
from pathlib import Path
from bench.scale_out import measured
from bench.common import FAKE
w, share, rows = Path(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
shutil.rmtree(w / "out", ignore_errors=True); shutil.rmtree(w / "killed", ignore_errors=True)
env = os.environ | {FAKE: str(w / "model")}
print(measured(["run", str(w / "job.toml"), "--replicas", "2"], env, w, int(share * rows)))
subprocess.run(["cp", "-al", str(w / "out"), str(w / "killed")], check=True)
