"""The adaptive policies of a worker, each behind one contract (base.py): pass 1's recipe (recipe.py), auto's
engine switches (auto.py) and the speculation audit (audit.py). The worker applies their answers (worker.py)."""
