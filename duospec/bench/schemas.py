"""Realistic JSON schemas (nested objects, arrays, enums, patterns) and a chat question for each: what
benchmarks/structured.py measures and tests/e2e/test_structured_smollm2.py checks on the real model."""

from __future__ import annotations

NAME = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "person": {"type": "object", "additionalProperties": False, "required": ["name", "age", "email"],
               "properties": {"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                              "email": {"type": "string", "pattern": "^[a-z]{1,10}@[a-z]{1,10}\\.com$"}}},
    "order": {"type": "object", "additionalProperties": False, "required": ["id", "items", "status"],
              "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99999},
                             "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {
                                 "type": "object", "additionalProperties": False, "required": ["sku", "qty"],
                                 "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                                                "qty": {"type": "integer", "minimum": 1, "maximum": 9}}}},
                             "status": {"enum": ["pending", "shipped", "delivered"]}}},
    "weather": {"type": "object", "additionalProperties": False, "required": ["city", "forecast"],
                "properties": {"city": NAME, "forecast": {"type": "array", "minItems": 2, "maxItems": 3, "items": {
                    "type": "object", "additionalProperties": False, "required": ["day", "sky", "high_c"],
                    "properties": {"day": {"enum": ["mon", "tue", "wed", "thu", "fri", "sat", "sun"]},
                                   "sky": {"enum": ["sunny", "cloudy", "rain", "snow"]},
                                   "high_c": {"type": "integer", "minimum": -30, "maximum": 45}}}}}},
    "review": {"type": "object", "additionalProperties": False, "required": ["title", "stars", "pros", "cons"],
               "properties": {"title": NAME, "stars": {"type": "integer", "minimum": 1, "maximum": 5},
                              "pros": {"type": "array", "maxItems": 2, "items": NAME},
                              "cons": {"type": "array", "maxItems": 2, "items": NAME}}},
    "event": {"type": "object", "additionalProperties": False, "required": ["title", "date", "attendees", "online"],
              "properties": {"title": NAME, "date": {"type": "string", "pattern": "^2026-[01][0-9]-[0-3][0-9]$"},
                             "attendees": {"type": "array", "maxItems": 3, "items": {
                                 "type": "object", "additionalProperties": False, "required": ["name", "role"],
                                 "properties": {"name": NAME, "role": {"enum": ["host", "guest"]}}}},
                             "online": {"type": "boolean"}}},
}
QUESTIONS = {
    "person": "Describe a person as JSON.",
    "order": "Give me a JSON order with two items.",
    "weather": "Give the weather forecast for Paris as JSON.",
    "review": "Review a coffee shop as JSON.",
    "event": "Describe a team meeting as JSON.",
}
