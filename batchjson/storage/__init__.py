"""Where a run's files live, how they are committed and how the folder is locked.

names.py (every name, scalar and Arrow forms) · folder.py (layout, claim, swap, fingerprints) · commits.py (the unit
commits: begin, stage, write_record, publish; recover, drop; the records) · survey.py (the resume's survey) ·
index.py (the index as a run keeps it) · index_file.py (its files) · listings.py (folders listed as Arrow tables) ·
locks.py (flock, leases) · location.py (local path or object-storage URI) · progress.py (the progress file `status`
reads, the cancel marker) · shelf.py (values by name, off the heap).
"""

from batchjson.storage.commits import Commits, DamagedRecord
from batchjson.storage.folder import STATE, Storage, hidden_below
from batchjson.storage.location import Location, Unreadable, glob_match, is_uri
from batchjson.storage.locks import Lease
from batchjson.storage.names import STAGED, Kind, PartName, Stage, UnitName

__all__ = ["STAGED", "STATE", "Commits", "DamagedRecord", "Kind", "Lease", "Location", "PartName", "Stage", "Storage", "UnitName",
           "Unreadable", "glob_match", "hidden_below", "is_uri"]
