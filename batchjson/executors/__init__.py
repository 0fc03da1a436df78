"""Where a job's workers run: in this process (inline.py), as local processes (local.py) or as Ray actors (ray.py).
Every executor runs the same worker body (worker.py) against the same queue (base.py)."""
