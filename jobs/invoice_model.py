"""jobs/sample.toml's schema (sample_data/schema.json) as a Pydantic model, for `[schema] pydantic =
"invoice_model:Invoice"` in a spec in this folder, or `schema={"pydantic": Invoice}` in Python."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class Item(BaseModel):
    model_config = ConfigDict(extra="forbid")  # additionalProperties: false

    description: str = Field(min_length=1, max_length=40)
    quantity: int = Field(ge=1, le=1000)
    unit_price: float = Field(ge=0, le=10000)


class Invoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    vendor: str = Field(min_length=1, max_length=60)
    currency: Literal["USD", "EUR", "GBP"]
    category: Literal["office", "travel", "software", "hardware"]
    total: float = Field(ge=0, le=100000)
    items: list[Item] = Field(min_length=1, max_length=5)
