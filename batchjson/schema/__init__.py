"""The job's JSON Schema: its shape, the grammar a backend decodes it with, and validation against it.

shape.py (subschemas, drafts, local refs, root types, bounds) · bundle.py (schema files -> one document) ·
pydantic_model.py (a Pydantic model's schema) · grammar.py (backend choice, grammar schema, coverage) ·
validate.py (generations -> outcomes) · drafts.py (draft tokens the grammar forces or the prompt holds). Nothing
is imported here: `batchjson check` and vLLM's engine processes import only the modules they use.
"""
