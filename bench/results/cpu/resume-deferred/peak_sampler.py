"""Resume the killed 100M folder (bench.scale_out's, restored from its `killed` copy by hard links) in this process with
a sampler: RSS, Python heap (tracemalloc, with `trace`), Arrow, and where each thread is at each new peak.
RESUME_DIR=<the folder holding job.toml, killed/, model> PYTHONPATH=<tree> python peak_sampler.py [trace]"""
import json, os, shutil, subprocess, sys, time, threading, tracemalloc
def main():
    W = os.environ["RESUME_DIR"]
    out = W + "/out"
    subprocess.run(["rm", "-rf", out], check=True)
    subprocess.run(["cp", "-al", W + "/killed", out], check=True)
    st = out + "/_batchjson"
    for p in os.listdir(st):
        if p not in ("units", "requeue"):
            q = os.path.join(st, p)
            shutil.rmtree(q) if os.path.isdir(q) else os.unlink(q)
            subprocess.run(["cp", "-a", W + "/killed/_batchjson/" + p, q], check=True)
    global TRACE, top, T0
    TRACE = len(sys.argv) > 1
    if TRACE:
        tracemalloc.start(12)
    import pyarrow as pa
    T0 = time.time()
    top = [0, None, 0, 0]
    def rss():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) // 1024 for l in f if l.startswith("VmRSS"))
    def where():
        import traceback
        out = []
        for tid, frame in sys._current_frames().items():
            name = next((t.name for t in threading.enumerate() if t.ident == tid), "?")
            if name.startswith(("Thread-1", "tqdm", "QueueFeeder")):
                continue
            fs = [f"{f.name}:{f.lineno}" for f in traceback.extract_stack(frame) if "batchjson" in f.filename][-4:]
            if fs:
                out.append(f"{name}<{'/'.join(fs)}>")
        return " ".join(out)
    def sample():
        last = 0
        while True:
            r = rss()
            if r > top[0] + 3:
                py = tracemalloc.get_traced_memory()[0] >> 20 if TRACE else 0
                ar = pa.total_allocated_bytes() >> 20
                top[0], top[2], top[3] = r, py, ar
                print(f"{time.time()-T0:7.2f} rss {r} py {py} arrow {ar} threads {[t.name for t in threading.enumerate()][-4:]} {where()}", flush=True)
                if TRACE and r > 330:
                    top[1] = tracemalloc.take_snapshot()
            time.sleep(0.05)
    threading.Thread(target=sample, daemon=True).start()
    os.environ["BATCHJSON_BENCH_FAKE"] = W + "/model"
    sys.argv = ["bench.fakerun", "run", W + "/job.toml", "--replicas", "2"]
    from bench import fakerun
    try:
        fakerun.main()
    except SystemExit as e:
        print("exit", e.code)
    print("peak", top[0], "py", top[2], "arrow", top[3], "hwm", open("/proc/self/status").read().split("VmHWM:")[1].split()[0])
    if top[1] is not None:
        for s in top[1].statistics("traceback")[:12]:
            print(s.size >> 20, "MiB", s.count, "blocks")
            for line in s.traceback.format()[-8:]:
                print("   ", line)

if __name__ == "__main__":
    main()
