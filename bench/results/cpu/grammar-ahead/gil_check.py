"""Whether xgrammar's batch fill and batch accept release the interpreter's lock: a Python loop's rate in the main
thread with each beside it on a thread, against a sha256 of 8 MB (releases it) and another Python loop (holds it).
python gil_check.py TOKENIZER_FOLDER   (1,024 matchers of a small JSON schema)"""
import sys, threading, time, json, hashlib
BIG = b'x' * (8 << 20)
import xgrammar as xgr, torch
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
info = xgr.TokenizerInfo.from_huggingface(tok)
comp = xgr.GrammarCompiler(info)
schema = json.dumps({"type": "object", "properties": {"name": {"type": "string"}, "items": {"type": "array", "items": {"type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer"}}}}}, "required": ["name", "items"]})
g = comp.compile_json_schema(schema)
N = 1024
ms = [xgr.GrammarMatcher(g) for _ in range(N)]
mask = xgr.allocate_token_bitmask(N, info.vocab_size)
batch = xgr.BatchGrammarMatcher(1)
def spin(seconds):
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n
def work(kind, stop):
    calls = 0
    while not stop.is_set():
        if kind == "fill":
            batch.batch_fill_next_token_bitmask(ms, mask, None)
        elif kind == "accept":
            xgr.BatchGrammarMatcher.batch_accept_token(ms, [123] * N)  # mostly refused, still walks each
        elif kind == "hash":
            hashlib.sha256(BIG).digest()
        elif kind == "python":
            sum(range(20000))
        calls += 1
    return calls
base = spin(1.0)
for kind in ("hash", "python", "fill", "accept", "hash"):
    stop = threading.Event(); out = {}
    t = threading.Thread(target=lambda: out.setdefault("calls", work(kind, stop))); t.start()
    n = spin(1.0); stop.set(); t.join()
    print(kind, "main loop rate with the thread beside:", round(n / base, 2), "calls", out["calls"])
