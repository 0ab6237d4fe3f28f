#!/usr/bin/env python3
"""Read broker messages as CloudEvents with the CloudEvents SDK for Python (PyPI `cloudevents`).

Used by e2e/tests/cloudevents.rs: a reader no one in this project wrote. Standard input holds one
JSON object per line, a message as the broker gave it:

    {"binding": "kafka" | "nats" | "redis", "headers": {name: value}, "key": str | null,
     "body_base64": str}

(`body_base64`: the body's bytes in base64, as a binary payload's body need not be UTF-8.)

(`headers` are a Kafka record's headers, a NATS message's headers, or a Redis entry's fields
other than `data`, whose value is `body`). Each message is parsed with the SDK's own binding
code, the content mode detected by the SDK:

- kafka: `cloudevents.core.bindings.kafka.from_kafka` (ce_ headers, content-type, the key as
  `partitionkey`);
- nats, redis: `cloudevents.core.bindings.http.from_http`: the NATS binding's binary mode is the
  HTTP binding's `ce-` header rules (percent-encoded values) with `datacontenttype` in
  `ce-datacontenttype`, which the HTTP reader takes as any `ce-` attribute; structured mode is
  `content-type: application/cloudevents+json` and the JSON event format. The Redis mapping is
  the HTTP binding's rules applied to entry fields.

Standard output gets one JSON object per message: {"attributes": {...}, "data": ...}, with
`time` in ISO 8601; when the SDK gives the data as bytes (a binary payload: the body of a
binary-mode event whose `datacontenttype` is not JSON, or a structured event's `data_base64`),
{"attributes": {...}, "data_base64": "..."} instead. Any parse error ends the script with a
non-zero status.
"""

import base64
import json
import sys

from cloudevents.core.bindings import http, kafka
from cloudevents.core.formats.json import JSONFormat


def parse(message):
    binding = message["binding"]
    body = base64.b64decode(message["body_base64"])
    if binding == "kafka":
        record = kafka.KafkaMessage(
            headers={k: v.encode("utf-8") for k, v in message["headers"].items()},
            key=message["key"],
            value=body,
        )
        return kafka.from_kafka(record, JSONFormat())
    if binding in ("nats", "redis"):
        return http.from_http(http.HTTPMessage(headers=message["headers"], body=body), JSONFormat())
    raise ValueError(f"unknown binding {binding!r}")


def main():
    for line in sys.stdin:
        if not line.strip():
            continue
        event = parse(json.loads(line))
        attributes = {}
        for name, value in event.get_attributes().items():
            attributes[name] = value.isoformat() if hasattr(value, "isoformat") else value
        data = event.get_data()
        if isinstance(data, (bytes, bytearray)):
            print(json.dumps({"attributes": attributes, "data_base64": base64.b64encode(data).decode()}))
        else:
            print(json.dumps({"attributes": attributes, "data": data}))


if __name__ == "__main__":
    main()
