"""Schemathesis hooks for deploy/check.sh (loaded through SCHEMATHESIS_HOOKS).

The job API also takes a job as TOML (`application/toml`, docs/openapi.yaml): the generated
body is text and goes on the wire as the text it is."""

import schemathesis

schemathesis.serializer.alias("application/toml", "text/plain")
