"""decentrl's benchmarks: each module measures one thing (trainer throughput, generation, the
swarm's bytes, an update's spread, trust checks, ...) and prints a table and one machine-readable
line `NAME key=value ...`; no test asserts a timing.

Run one with `decentrl bench NAME [options]` (`decentrl bench --help` lists them with a line
each, `decentrl bench NAME -- --help` lists a bench's options), or from the checkout root with
`python -m bench.NAME` (underscores in the module's name: `python -m bench.trainer_throughput`).
`bench.common` holds what the benches share. The figures measured so far, with their setup,
live in bench/README.md.

The package lives in the source checkout only: no wheel ships it, and decentrl never imports it.
"""
