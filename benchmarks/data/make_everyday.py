"""Run: python benchmarks/data/make_everyday.py. Writes benchmarks/data/schema_everyday.json: everyday schemas as applications send them (pydantic models'
model_json_schema(), OpenAI-style function-call parameter schemas, SchemaStore-like config schemas)."""
import datetime, enum, json, uuid
from typing import Literal, Optional, Annotated
import pydantic
from pydantic import BaseModel, Field

class Sentiment(str, enum.Enum):
    pos = "positive"; neg = "negative"; neu = "neutral"

class Classification(BaseModel):
    label: Sentiment
    confidence: float = Field(ge=0, le=1)

class Entity(BaseModel):
    text: str = Field(max_length=40)
    kind: Literal["person", "org", "place", "date", "other"]
    start: int = Field(ge=0)
    end: int = Field(ge=0)

class Entities(BaseModel):
    entities: list[Entity] = Field(max_length=5)

class Address(BaseModel):
    street: str
    city: str
    postcode: str = Field(pattern=r"^[0-9]{5}$")
    country: str = Field(min_length=2, max_length=2)

class Person(BaseModel):
    name: str
    age: Optional[int] = Field(default=None, ge=0, le=150)
    email: Optional[str] = None
    address: Optional[Address] = None
    tags: list[str] = []

class Invoice(BaseModel):
    id: uuid.UUID
    issued: datetime.date
    due: datetime.datetime
    lines: list[dict[str, float]] = Field(max_length=3)
    total: float = Field(ge=0)
    currency: Literal["EUR", "USD", "GBP"] = "EUR"
    paid: bool = False

class Review(BaseModel):
    rating: int = Field(ge=1, le=5)
    title: str = Field(max_length=60)
    pros: list[str] = Field(default_factory=list, max_length=3)
    cons: list[str] = Field(default_factory=list, max_length=3)
    recommend: bool

class QA(BaseModel):
    question: str
    answer: str
    evidence: list[Annotated[int, Field(ge=0)]] = []
    answerable: bool

class Summary(BaseModel):
    summary: str = Field(max_length=200)
    keywords: list[str] = Field(min_length=1, max_length=5)
    language: Literal["en", "de", "fr", "es", "other"]

class Node(BaseModel):
    name: str = Field(max_length=10)
    children: list["Node"] = Field(default_factory=list, max_length=2)

class Step(BaseModel):
    thought: str
    action: Literal["search", "lookup", "finish"]
    argument: Optional[str] = None

class Plan(BaseModel):
    steps: list[Step] = Field(min_length=1, max_length=4)
    final: Optional[str] = None

class Product(BaseModel):
    sku: str = Field(pattern=r"^[A-Z]{3}-[0-9]{4}$")
    name: str
    price: float = Field(gt=0)
    stock: int = Field(ge=0)
    categories: list[Literal["books", "toys", "food", "tools"]] = Field(default_factory=list)
    attributes: dict[str, str] = Field(default_factory=dict)

class Event(BaseModel):
    title: str
    when: datetime.datetime
    duration_minutes: int = Field(ge=5, le=480, multiple_of=5)
    attendees: list[str] = Field(default_factory=list, max_length=4)
    location: Optional[str] = None

class Cat(BaseModel):
    pet_type: Literal["cat"]
    meows: int = Field(ge=0, le=10)

class Dog(BaseModel):
    pet_type: Literal["dog"]
    barks: float

class Owner(BaseModel):
    pet: Cat | Dog = Field(discriminator="pet_type")
    n: int

class Moderation(BaseModel):
    flagged: bool
    categories: dict[Literal["hate", "violence", "sexual", "self-harm"], bool]
    scores: dict[str, Annotated[float, Field(ge=0, le=1)]]

class Translation(BaseModel):
    source_language: str = Field(min_length=2, max_length=5)
    target_language: str = Field(min_length=2, max_length=5)
    text: str

class SQLQuery(BaseModel):
    table: Literal["users", "orders", "items"]
    columns: list[str] = Field(min_length=1, max_length=4)
    where: Optional[dict[str, str | int | bool]] = None
    limit: int = Field(default=10, ge=1, le=100)

class Triple(BaseModel):
    subject: str
    predicate: str
    object: str

class Graph(BaseModel):
    triples: list[Triple] = Field(max_length=4)

class Meeting(BaseModel):
    date: datetime.date
    time: datetime.time
    participants: list[Person] = Field(max_length=2)

class Score(BaseModel):
    value: Annotated[float, Field(ge=-1, le=1)]
    label: Optional[Literal["low", "mid", "high"]] = None

class Config(BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")
    name: str
    retries: int = Field(3, ge=0, le=10)
    verbose: bool = False
    mode: Literal["fast", "safe"] = "safe"

MODELS = [Classification, Entity, Entities, Address, Person, Invoice, Review, QA, Summary, Node, Step, Plan, Product,
          Event, Owner, Moderation, Translation, SQLQuery, Triple, Graph, Meeting, Score, Config]

def fn(name, props, required, extra=None):
    return {"name": f"function call: {name}", "schema": {"type": "object", "properties": props, "required": required,
            "additionalProperties": False, **(extra or {})}}

S = {"type": "string"}
FUNCTIONS = [
    fn("get_weather", {"location": {"type": "string", "description": "City and country"},
                       "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, ["location"]),
    fn("search_web", {"query": S, "max_results": {"type": "integer", "minimum": 1, "maximum": 10}}, ["query"]),
    fn("send_email", {"to": {"type": "array", "items": {"type": "string", "format": "email"}, "minItems": 1, "maxItems": 3},
                      "subject": {"type": "string", "maxLength": 80}, "body": S, "cc": {"type": "array", "items": S}}, ["to", "subject", "body"]),
    fn("create_calendar_event", {"title": S, "start": {"type": "string", "format": "date-time"},
                                 "end": {"type": "string", "format": "date-time"}, "all_day": {"type": "boolean"}}, ["title", "start"]),
    fn("get_stock_price", {"ticker": {"type": "string", "pattern": "^[A-Z]{1,5}$"}}, ["ticker"]),
    fn("convert_currency", {"amount": {"type": "number", "exclusiveMinimum": 0}, "from": {"type": "string", "enum": ["USD", "EUR", "JPY"]},
                            "to": {"type": "string", "enum": ["USD", "EUR", "JPY"]}}, ["amount", "from", "to"]),
    fn("book_flight", {"origin": {"type": "string", "minLength": 3, "maxLength": 3}, "destination": {"type": "string", "minLength": 3, "maxLength": 3},
                       "date": {"type": "string", "format": "date"}, "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                       "class": {"type": "string", "enum": ["economy", "business", "first"]}}, ["origin", "destination", "date"]),
    fn("run_sql", {"query": S, "read_only": {"type": "boolean", "default": True}}, ["query"]),
    fn("set_thermostat", {"temperature": {"type": "number", "minimum": 10, "maximum": 30}, "room": S}, ["temperature"]),
    fn("translate", {"text": S, "target": {"type": "string", "enum": ["en", "de", "fr", "ja"]}}, ["text", "target"]),
    fn("get_user", {"user_id": {"type": "integer", "minimum": 1}}, ["user_id"]),
    fn("update_ticket", {"id": {"type": "integer"}, "status": {"type": "string", "enum": ["open", "pending", "closed"]},
                         "priority": {"type": ["integer", "null"], "minimum": 1, "maximum": 4}, "comment": S}, ["id", "status"]),
    fn("list_files", {"path": S, "recursive": {"type": "boolean"}, "pattern": S}, ["path"]),
    fn("add_todo", {"title": {"type": "string", "maxLength": 50}, "due": {"type": "string", "format": "date"},
                    "tags": {"type": "array", "items": {"type": "string"}, "uniqueItems": False, "maxItems": 4}}, ["title"]),
    fn("geocode", {"address": S, "bounds": {"type": "array", "prefixItems": [{"type": "number"}, {"type": "number"}],
                                            "items": False, "minItems": 2}}, ["address"]),
    fn("rate_limit", {"requests": {"type": "integer", "minimum": 1}, "per": {"enum": ["second", "minute", "hour"]}}, ["requests", "per"]),
    fn("resize_image", {"width": {"type": "integer", "minimum": 1, "maximum": 4096}, "height": {"type": "integer", "minimum": 1, "maximum": 4096},
                        "format": {"enum": ["png", "jpeg", "webp"]}, "keep_aspect": {"type": "boolean"}}, ["width", "height"]),
    fn("play_music", {"artist": S, "song": S, "shuffle": {"type": "boolean"}}, []),
    fn("order_pizza", {"size": {"enum": ["s", "m", "l"]}, "toppings": {"type": "array", "items": {"enum": ["cheese", "ham", "mushroom", "olive"]}, "maxItems": 4},
                       "address": {"type": "object", "properties": {"street": S, "number": {"type": "integer"}}, "required": ["street"], "additionalProperties": False}},
       ["size", "address"]),
    fn("search_products", {"query": S, "filters": {"type": "object", "additionalProperties": {"type": "string"}},
                           "sort": {"enum": ["price", "rating", "newest"]}}, ["query"]),
    fn("calculate", {"expression": S, "precision": {"type": "integer", "minimum": 0, "maximum": 10}}, ["expression"]),
    fn("get_directions", {"from": S, "to": S, "mode": {"enum": ["driving", "walking", "transit", "cycling"]},
                          "avoid": {"type": "array", "items": {"enum": ["tolls", "highways", "ferries"]}}}, ["from", "to"]),
    fn("create_issue", {"repo": {"type": "string", "pattern": "^[a-z0-9-]+/[a-z0-9-]+$"}, "title": S, "labels": {"type": "array", "items": S},
                        "assignee": {"type": ["string", "null"]}}, ["repo", "title"]),
    fn("schedule_reminder", {"message": S, "in_minutes": {"type": "integer", "minimum": 1, "maximum": 10080}}, ["message", "in_minutes"]),
    fn("lookup_definition", {"word": {"type": "string", "pattern": "^[a-z]+$"}, "language": {"const": "en"}}, ["word"]),
    fn("no_arguments", {}, []),
    fn("nullable_args", {"a": {"anyOf": [{"type": "string"}, {"type": "null"}]}, "b": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None}}, ["a"]),
    fn("nested_refs", {"item": {"$ref": "#/$defs/item"}, "items": {"type": "array", "items": {"$ref": "#/$defs/item"}, "maxItems": 2}}, ["item"],
       {"$defs": {"item": {"type": "object", "properties": {"id": {"type": "integer"}, "note": S}, "required": ["id"], "additionalProperties": False}}}),
]

CONFIGS = [
    {"name": "config: package.json subset", "schema": {"type": "object", "properties": {
        "name": {"type": "string", "pattern": "^[a-z0-9-]+$", "maxLength": 214}, "version": {"type": "string", "pattern": "^[0-9]+\\.[0-9]+\\.[0-9]+$"},
        "private": {"type": "boolean"}, "scripts": {"type": "object", "additionalProperties": {"type": "string"}},
        "dependencies": {"type": "object", "additionalProperties": {"type": "string"}}, "license": {"type": "string"}},
        "required": ["name", "version"]}},
    {"name": "config: compose service subset", "schema": {"type": "object", "properties": {
        "image": {"type": "string"}, "restart": {"enum": ["no", "always", "on-failure", "unless-stopped"]},
        "ports": {"type": "array", "items": {"type": "string", "pattern": "^[0-9]{2,5}:[0-9]{2,5}$"}, "maxItems": 3},
        "environment": {"type": "object", "additionalProperties": {"type": ["string", "number", "boolean", "null"]}},
        "depends_on": {"type": "array", "items": {"type": "string"}}}, "required": ["image"], "additionalProperties": False}},
    {"name": "config: tsconfig subset", "schema": {"type": "object", "properties": {"compilerOptions": {"type": "object", "properties": {
        "target": {"enum": ["es5", "es2015", "es2020", "esnext"]}, "strict": {"type": "boolean"}, "outDir": {"type": "string"},
        "lib": {"type": "array", "items": {"type": "string"}}}, "additionalProperties": False}, "include": {"type": "array", "items": {"type": "string"}}}}},
    {"name": "config: github workflow subset", "schema": {"type": "object", "properties": {"name": {"type": "string"},
        "on": {"anyOf": [{"enum": ["push", "pull_request"]}, {"type": "array", "items": {"enum": ["push", "pull_request", "workflow_dispatch"]}}]},
        "jobs": {"type": "object", "additionalProperties": {"type": "object", "properties": {"runs-on": {"type": "string"},
            "steps": {"type": "array", "items": {"type": "object", "properties": {"uses": {"type": "string"}, "run": {"type": "string"}}}, "maxItems": 3}},
            "required": ["runs-on"]}, "maxProperties": 2}}, "required": ["on", "jobs"]}},
    {"name": "config: logging", "schema": {"type": "object", "properties": {"level": {"enum": ["DEBUG", "INFO", "WARNING", "ERROR"]},
        "handlers": {"type": "array", "items": {"type": "object", "properties": {"kind": {"enum": ["file", "stream"]}, "path": {"type": "string"}}, "required": ["kind"]}}},
        "required": ["level"]}},
    {"name": "config: feature flags", "schema": {"type": "object", "additionalProperties": {"type": "boolean"}, "maxProperties": 5}},
    {"name": "config: eslint rules subset", "schema": {"type": "object", "properties": {"rules": {"type": "object", "additionalProperties": {
        "anyOf": [{"enum": ["off", "warn", "error"]}, {"type": "integer", "minimum": 0, "maximum": 2}]}}}}},
    {"name": "config: openapi info", "schema": {"type": "object", "properties": {"title": {"type": "string"}, "version": {"type": "string"},
        "contact": {"type": "object", "properties": {"name": {"type": "string"}, "url": {"type": "string", "format": "uri"}, "email": {"type": "string", "format": "email"}}},
        "license": {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}, "required": ["title", "version"]}},
    {"name": "config: cron job", "schema": {"type": "object", "properties": {"schedule": {"type": "string", "pattern": "^[0-9*/ ,-]+$"},
        "command": {"type": "string"}, "timeout_s": {"type": "integer", "minimum": 1, "maximum": 86400}, "enabled": {"type": "boolean"}}, "required": ["schedule", "command"]}},
    {"name": "config: k8s resources", "schema": {"type": "object", "properties": {"limits": {"type": "object", "properties": {"cpu": {"type": "string"}, "memory": {"type": "string", "pattern": "^[0-9]+(Mi|Gi)$"}}},
        "requests": {"type": "object", "properties": {"cpu": {"type": "string"}, "memory": {"type": "string"}}}}}},
    {"name": "config: nullable union draft7", "schema": {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
        "properties": {"port": {"type": ["integer", "null"], "minimum": 1, "maximum": 65535}, "host": {"type": "string"}},
        "required": ["host"], "definitions": {"unused": {"type": "string"}}}},
    {"name": "config: draft7 refs", "schema": {"$schema": "http://json-schema.org/draft-07/schema#", "definitions": {"pos": {"type": "integer", "minimum": 0}},
        "type": "object", "properties": {"x": {"$ref": "#/definitions/pos"}, "y": {"$ref": "#/definitions/pos"}}, "required": ["x", "y"]}},
]

out = [{"name": f"pydantic {m.__name__}", "group": "everyday", "schema": m.model_json_schema()} for m in MODELS]
out += [{**c, "group": "everyday"} for c in FUNCTIONS + CONFIGS]
doc = {"source": "written for tokenmill: pydantic models' model_json_schema() (pydantic %s), OpenAI-style function-call "
       "parameter schemas, SchemaStore-like config subsets" % pydantic.VERSION, "schemas": out}
json.dump(doc, open(__file__.replace("make_everyday.py", "schema_everyday.json"), "w"), indent=0)
print(len(out))
