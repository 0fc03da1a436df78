"""Generate synthetic invoice/receipt prose with ground-truth JSON and write it to Parquet."""
import argparse
import json
import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

# Per category: vendors, a word the prose uses for the purchase, and items with a
# unit-price range in cents. Vendors/items are category-specific so the category is
# inferable from the text even though it is never named as a schema value.
CATALOG = {
    "office": (["Paperline Supplies Ltd", "Staple & Co", "Northwind Office Goods", "DeskDepot"],
               "office supplies",
               [("A4 copy paper ream", 399, 899), ("box of ballpoint pens", 650, 1500),
                ("desk organizer", 1200, 3500), ("whiteboard markers", 450, 1200),
                ("ergonomic office chair", 14900, 45000)]),
    "travel": (["SkyBridge Travel Agency", "Globetrotter Business Travel", "Wayfarer Corporate Trips",
                "Compass Travel Partners"],
               "travel costs",
               [("economy flight ticket", 8900, 64000), ("hotel room night", 7900, 26000),
                ("airport taxi ride", 2500, 9000), ("second-class train ticket", 1900, 15000),
                ("conference shuttle pass", 1500, 4000)]),
    "software": (["Cloudnine Software Inc", "Lumen Analytics GmbH", "CodeForge Tools", "Datavault SaaS"],
                 "software subscriptions",
                 [("annual license seat", 9900, 59900), ("monthly cloud storage plan", 499, 4999),
                  ("support and maintenance plan", 19900, 99900), ("API usage credits", 1000, 25000),
                  ("design tool subscription", 1200, 6000)]),
    "hardware": (["Voltmart Electronics", "Byte & Bolt Hardware", "Circuit City Trading", "PixelPro Devices"],
                 "computer hardware",
                 [("27-inch monitor", 17900, 49900), ("USB-C docking station", 8900, 27900),
                  ("wireless keyboard", 2900, 12900), ("laptop", 79900, 249900),
                  ("external SSD 1TB", 6900, 18900)]),
}
# The text may show a symbol, an ISO code or a spoken name; mapping it back is part of the task.
CURRENCIES = {"USD": ("$", "US dollars"), "EUR": ("€", "euros"), "GBP": ("£", "pounds sterling")}
OPENINGS = [
    "Invoice {ref} from {vendor}, dated {date}, covers the {catword} we ordered for {reason}.",
    "On {date} we received a receipt from {vendor} for {catword} bought for {reason}.",
    "{vendor} billed us on {date} under reference {ref} for {catword} needed for {reason}.",
    "Please file this expense: {vendor} sent invoice {ref} on {date} for {catword} related to {reason}.",
]
REASONS = ["the Berlin office", "the Q3 sales project", "the client workshop in March",
           "our annual planning offsite", "the London team"]
LINES = ["{q} x {desc} at {price} each", "{q} units of {desc} priced at {price} per unit",
         "{desc}, quantity {q}, at {price} apiece", "{desc} (qty {q}) at {price} each"]
ITEM_INTROS = ["The order lists", "It includes", "Line items are", "They charged for"]
CLOSINGS = [
    "The total due is {total}, payable within 30 days of the invoice date.",
    "Altogether we were charged {total}, which has already been paid by company card.",
    "All amounts are in {curname} and the invoice total comes to {total}.",
    "This brings the grand total to {total}, to be settled by bank transfer.",
]


def money(cents, code, style):
    """Format an amount; style is fixed per text so one document is self-consistent."""
    amount = f"{cents / 100:.2f}"
    sym = CURRENCIES[code][0]
    return {0: f"{sym}{amount}", 1: f"{amount} {code}", 2: f"{code} {amount}"}[style]


def make_row(rng, max_items):
    """Return (text, truth_dict); retried by the caller until the word count fits."""
    category = rng.choice(list(CATALOG))
    vendors, catword, catalog = CATALOG[category]
    vendor, code, style = rng.choice(vendors), rng.choice(list(CURRENCIES)), rng.randrange(3)
    picks = rng.sample(catalog, rng.randint(1, max_items))
    items = [(desc, rng.randint(1, 12), rng.randint(lo, hi)) for desc, lo, hi in picks]
    total_cents = sum(q * c for _, q, c in items)  # integer cents: no float drift in the truth
    lines = [rng.choice(LINES).format(q=q, desc=d, price=money(c, code, style)) for d, q, c in items]
    # Semicolons separate items because some phrasings contain commas themselves.
    listed = lines[0] if len(lines) == 1 else "; ".join(lines[:-1]) + "; and " + lines[-1]
    date = f"{rng.randint(2022, 2025)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
    text = " ".join([
        rng.choice(OPENINGS).format(ref=f"#{rng.randint(1000, 99999)}", vendor=vendor, date=date,
                                    catword=catword, reason=rng.choice(REASONS)),
        f"{rng.choice(ITEM_INTROS)} {listed}.",
        rng.choice(CLOSINGS).format(total=money(total_cents, code, style), curname=CURRENCIES[code][1]),
    ])
    truth = {"vendor": vendor, "currency": code, "category": category, "total": total_cents / 100,
             "items": [{"description": d, "quantity": q, "unit_price": c / 100} for d, q, c in items]}
    return text, truth


def rows(n, seed, max_items):
    """Yield (id, text, source, truth_json) deterministically from a single seeded stream."""
    rng = random.Random(seed)
    for i in range(1, n + 1):
        while True:  # rejection keeps texts within 40-90 words without a fourth sentence
            text, truth = make_row(rng, max_items)
            if 40 <= len(text.split()) <= 90:
                break
        yield (f"inv-{i:05d}", text, rng.choice(["email", "scan", "portal"]),
               json.dumps(truth, ensure_ascii=False, separators=(",", ":")))


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--rows", type=int, default=120)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(Path(__file__).with_name("sample.parquet")))
    ap.add_argument("--max-items", type=int, default=3, choices=range(1, 6),
                    help="items per text are 1..N (schema allows up to 5)")
    ap.add_argument("--row-group", type=int, default=10_000)
    args = ap.parse_args()
    names = ["id", "text", "source", "truth"]
    schema = pa.schema([(c, pa.string()) for c in names])
    # Stream fixed-size row groups so 10^5-10^6 row benchmark files never sit in memory whole.
    with pq.ParquetWriter(args.out, schema) as writer:
        batch = []
        for i, row in enumerate(rows(args.rows, args.seed, args.max_items), 1):
            batch.append(row)
            if len(batch) == args.row_group or i == args.rows:
                writer.write_table(pa.Table.from_arrays([pa.array(c, pa.string()) for c in zip(*batch)],
                                                        schema=schema))
                batch = []
    print(f"wrote {args.rows} rows to {args.out}")


if __name__ == "__main__":
    main()
