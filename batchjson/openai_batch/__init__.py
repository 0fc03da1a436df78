"""OpenAI Batch files in and out: a requests JSONL -> Parquet inputs and jobs, one per schema and sampling settings
(requests.py); the finished jobs -> the Batch output JSONL and its error file, in the requests' order
(responses.py).

Both stream. The import writes each job's rows to Parquet a row group at a time and keeps 8 bytes per request (a
hash of its custom_id, for the duplicate check); the export reads one unit of work per job at a time and merges
the jobs by the requests' line numbers.

The folder an import writes, which the export reads:

    DIR/openai_batch.json           the requests file, its count of requests, and the jobs
    DIR/<job>/job.toml, schema.json a job `batchjson run` runs as it is
    DIR/<job>/input/requests.parquet  custom_id, line (in the requests file), messages
    DIR/<job>/out/                  the job's output folder (output.path)
"""

from batchjson.openai_batch.requests import Imported, import_requests, parse_request
from batchjson.openai_batch.responses import Exported, export_results

__all__ = ["Exported", "Imported", "export_results", "import_requests", "parse_request"]
