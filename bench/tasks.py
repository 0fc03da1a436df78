"""Three extraction tasks with ground truth, and a free-text one, generated from a seed: input text, JSON Schema,
expected answer.

The schemas below carry maxItems/maxLength bounds; the benchmark uses them without (`schema(name)`), as a new
user's schema would be, unless asked for the bounded ones.

    A  invoice -> vendor, enums, total and a nested list of line-item objects (the sample task, 1-5 items)
    B  support ticket -> two enums, two lists of enums, a boolean
    C  sign-up note -> a flat object of five fields
    D  support ticket -> one free-text field, a reply in the model's own words: the schema forces little and the
       answer copies little from the prompt, so schema drafts have little to propose (no ground truth: an answer is
       right when its reply is not empty)

`write_task(name, rows, folder, seed)` writes the Parquet input (id, text, truth) and a job spec for it;
`score(name, value, truth)` says whether an answer is exactly right and which share of its fields is.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from sample_data.make_sample import make_row as invoice_row

ROOT = Path(__file__).resolve().parents[1]

INVOICE_SCHEMA = json.loads((ROOT / "sample_data" / "schema.json").read_text())

PRODUCTS = {"billing": "the billing portal", "mobile_app": "the mobile app", "web_dashboard": "the web dashboard",
            "api": "the REST API", "integrations": "the Slack integration"}
SEVERITY = {"low": "It is not urgent.", "medium": "They would like it fixed this week.",
            "high": "It blocks part of their team.", "critical": "Their whole company is blocked."}
PLATFORMS = {"windows": "Windows", "macos": "macOS", "linux": "Linux", "ios": "iOS", "android": "Android",
             "web": "the browser"}
ISSUES = {"login": "they cannot log in", "crash": "it keeps crashing", "slow": "it is very slow",
          "data_loss": "saved data was lost", "payment": "they were charged twice",
          "notification": "notifications no longer arrive", "sync": "changes do not sync", "export": "reports cannot be exported"}
TICKET_SCHEMA = {
    "type": "object",
    "properties": {
        "product": {"type": "string", "enum": list(PRODUCTS)},
        "severity": {"type": "string", "enum": list(SEVERITY)},
        "platforms": {"type": "array", "items": {"type": "string", "enum": list(PLATFORMS)}, "minItems": 1, "maxItems": 3},
        "issues": {"type": "array", "items": {"type": "string", "enum": list(ISSUES)}, "minItems": 1, "maxItems": 3},
        "wants_callback": {"type": "boolean"},
    },
    "required": ["product", "severity", "platforms", "issues", "wants_callback"],
    "additionalProperties": False,
}

FIRST = ["Maria", "James", "Aiko", "Lars", "Fatima", "Diego", "Chloe", "Omar", "Priya", "Tomasz", "Grace", "Kwame"]
LAST = ["Lopez", "Smith", "Tanaka", "Berg", "Haddad", "Ruiz", "Martin", "Khan", "Patel", "Nowak", "Okafor", "Mensah"]
CITIES = ["Porto", "Leeds", "Osaka", "Bergen", "Tunis", "Seville", "Lyon", "Karachi", "Pune", "Gdansk", "Accra", "Denver"]
PLANS = ["free", "pro", "team"]
CONTACT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 40},
        "age": {"type": "integer", "minimum": 16, "maximum": 99},
        "city": {"type": "string", "minLength": 1, "maxLength": 30},
        "email": {"type": "string", "minLength": 3, "maxLength": 60},
        "plan": {"type": "string", "enum": PLANS},
    },
    "required": ["name", "age", "city", "email", "plan"],
    "additionalProperties": False,
}
REPLY_SCHEMA = {
    "type": "object",
    "properties": {"reply": {"type": "string", "minLength": 1, "maxLength": 600}},
    "required": ["reply"],
    "additionalProperties": False,
}


def unbounded(schema):
    """The schema without maxItems/maxLength, as a new user tends to write it: then nothing in the grammar ends a
    loop inside an array or a string before max_tokens."""
    if isinstance(schema, dict):
        return {k: unbounded(v) for k, v in schema.items() if k not in ("maxItems", "maxLength")}
    if isinstance(schema, list):
        return [unbounded(v) for v in schema]
    return schema


def schema(name: str, bounded: bool = False) -> dict:
    return TASKS[name]["schema"] if bounded else unbounded(TASKS[name]["schema"])


def _and(words: list[str]) -> str:
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def ticket_row(rng: random.Random) -> tuple[str, dict]:
    product, severity = rng.choice(list(PRODUCTS)), rng.choice(list(SEVERITY))
    platforms = rng.sample(list(PLATFORMS), rng.randint(1, 3))
    issues = rng.sample(list(ISSUES), rng.randint(1, 3))
    callback = rng.random() < 0.5
    text = " ".join([
        f"Ticket #{rng.randint(1000, 99999)}: a customer writes about {PRODUCTS[product]}:",
        f"{_and([ISSUES[i] for i in issues])}.",
        f"This happens on {_and([PLATFORMS[p] for p in platforms])}.",
        SEVERITY[severity],
        "They asked us to call them back." if callback else "They prefer to be answered by email.",
    ])
    return text, {"product": product, "severity": severity, "platforms": platforms, "issues": issues,
                  "wants_callback": callback}


def contact_row(rng: random.Random) -> tuple[str, dict]:
    first, last, city, plan = rng.choice(FIRST), rng.choice(LAST), rng.choice(CITIES), rng.choice(PLANS)
    age = rng.randint(18, 80)
    email = f"{first.lower()}.{last.lower()}{rng.randint(1, 99)}@{rng.choice(['example.com', 'mail.org', 'post.net'])}"
    text = rng.choice([
        f"New sign-up: {first} {last} ({age}) from {city} chose the {plan} plan; email {email}.",
        f"{first} {last}, aged {age}, lives in {city} and registered {email} on the {plan} plan.",
        f"Please add {first} {last} to the {plan} plan. {first} is {age}, based in {city}, reachable at {email}.",
    ])
    return text, {"name": f"{first} {last}", "age": age, "city": city, "email": email, "plan": plan}


def reply_row(rng: random.Random) -> tuple[str, dict]:
    return ticket_row(rng)[0], {}


TASKS = {
    "A": {"shape": "nested list of objects (invoice line items)", "make": lambda rng: invoice_row(rng, 5),
          "schema": INVOICE_SCHEMA, "unordered": (),
          "system": "You extract invoice data from text and answer with JSON only.",
          "template": "Extract the vendor, the currency (USD, EUR or GBP), the category (office, travel, software or "
                      "hardware), the total, and the line items (description, quantity, unit_price) from this "
                      "invoice.\n\n{text}"},
    "B": {"shape": "lists of enums, enums, a boolean (support ticket)", "make": ticket_row, "schema": TICKET_SCHEMA,
          "unordered": ("platforms", "issues"),
          "system": "You triage support tickets and answer with JSON only.",
          "template": "Give the product, the severity, the platforms, the issue types and whether the customer wants "
                      "a call back for this support ticket.\n\n{text}"},
    "C": {"shape": "flat object of five fields (sign-up note)", "make": contact_row, "schema": CONTACT_SCHEMA,
          "unordered": (),
          "system": "You extract contact records from text and answer with JSON only.",
          "template": "Extract the name, age, city, email and plan of this person.\n\n{text}"},
    "D": {"shape": "one free-text field (a reply to a support ticket)", "make": reply_row, "schema": REPLY_SCHEMA,
          "unordered": (),
          "system": "You answer customers' support tickets and answer with JSON only.",
          "template": "Write a short, polite reply to this customer in two or three sentences.\n\n{text}"},
}


def rows(name: str, n: int, seed: int = 0) -> list[tuple[str, str, str]]:
    """(id, text, truth JSON) for n rows of task `name`; the same seed gives the same rows."""
    rng = random.Random(f"{name}-{seed}")
    out = []
    for i in range(n):
        text, truth = TASKS[name]["make"](rng)
        out.append((f"{name}-{i:05d}", text, json.dumps(truth, separators=(",", ":"))))
    return out


def write_task(name: str, n: int, folder: Path, model: str, seed: int = 0, max_tokens: int = 384,
               extra: str = "", bounded: bool = False) -> tuple[Path, Path]:
    """The Parquet input and a job spec (a new user's: only the required tables and max_tokens) for task `name`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"task{name}-{n}-s{seed}.parquet"
    if not data.exists():
        ids, texts, truths = zip(*rows(name, n, seed))
        pq.write_table(pa.table({"id": list(ids), "text": list(texts), "truth": list(truths)}), data)
    (folder / f"task{name}.schema.json").write_text(json.dumps(schema(name, bounded)))
    t = TASKS[name]
    job = folder / f"task{name}.toml"
    job.write_text(f"""[input]
path = {json.dumps(str(data))}

[prompt]
system = {json.dumps(t["system"])}
template = {json.dumps(t["template"])}

[schema]
path = "task{name}.schema.json"

[model]
path = {json.dumps(model)}

[sampling]
max_tokens = {max_tokens}

[output]
path = "out-{name}"
if_exists = "overwrite"
max_reject_rate = 1.0
{extra}""")
    return data, job


def _norm(value, unordered=()):
    if isinstance(value, float):
        return round(value, 2)
    if isinstance(value, dict):
        return {k: sorted(map(_norm, v)) if k in unordered and isinstance(v, list) else _norm(v)
                for k, v in value.items()}
    if isinstance(value, list):
        return [_norm(v) for v in value]
    if isinstance(value, str):
        return value.strip()
    return value


def score(name: str, value: dict | None, truth: dict | str) -> tuple[bool, float]:
    """(exactly right, share of top-level fields right); lists of enums in B compare as sets; D, with no ground truth,
    is right when every field is a non-empty string."""
    if isinstance(truth, str):
        truth = json.loads(truth)
    if not isinstance(value, dict):
        return False, 0.0
    if not truth:
        right = bool(value) and all(isinstance(v, str) and v.strip() for v in value.values())
        return right, float(right)
    un = TASKS[name]["unordered"]
    got, want = _norm(value, un), _norm(truth, un)
    fields = [got.get(k) == v for k, v in want.items()]
    return got == want, sum(fields) / len(fields)
