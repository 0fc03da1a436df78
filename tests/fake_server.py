"""Runs `batchjson serve` on the fake engine, for tests that kill the server:

    python tests/fake_server.py STATE PORT MODEL

FAKE_DELAY (seconds per answer), FAKE_VALID (the share of valid answers, 0.6), FAKE_ROWS_PER_GROUP (rows per unit of
work of an imported batch: the requests committed at a time).
"""

import os
import sys

from batchjson.engine.fake import FakeEngines
from batchjson.openai_batch import requests
from batchjson.serve import serve


def main():
    state, port, model = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    if os.environ.get("FAKE_ROWS_PER_GROUP"):
        requests.ROWS_PER_GROUP = int(os.environ["FAKE_ROWS_PER_GROUP"])
    engines = FakeEngines(delay=float(os.environ.get("FAKE_DELAY", "0")),
                          valid=float(os.environ.get("FAKE_VALID", "0.6")))
    serve(state, port=port, model=model, engine_factory=engines, log_level="warning",
          api_key=os.environ.get("FAKE_API_KEY") or None)


if __name__ == "__main__":
    main()
