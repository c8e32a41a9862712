"""What signing and checking one DHT record costs.

Every DHT record is signed by its writer and checked by every node that stores it or reads it
(net/records.py, `SignedRecordValidator`). This times, on the CPU, one writer's `sign_value` and
one reader's `validate` + `strip_value` of a record as hivemind hands it to the validator (key id,
serialized subkey and body, expiration time), for a peer's announcement (a `PeerRecord`, ~150
bytes) and for a body at the size limit (`MAX_RECORD_BYTES`, 64 KiB). Per record: microseconds to
sign, to validate, and their sum, the median of `--repeats` runs of `--records` records each.

For scale: a peer re-announces every `swarm.announce_every_s` (2 s) and a reader refreshes each
stage's key as often, so a node signs about one record and checks a few dozen a second.

Run: decentrl bench record-signing [--records 2000] [--repeats 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from bench import common
from decentrl.net.identity import Identity
from decentrl.net.protocol import PeerRecord, stage_key
from decentrl.net.records import MAX_RECORD_BYTES, SignedRecordValidator
from decentrl.net.wire import encode_struct

ANNOUNCEMENT = encode_struct(PeerRecord(
    name="peer", stage=0, layers=(0, 15), role="inference", version=12, tokens_per_s=123.4,
    free_sessions=8, training_ready=False, bytes_sent=123456789))
BODIES = {"announcement": ANNOUNCEMENT, "limit": bytes(MAX_RECORD_BYTES)}


def time_records(body: bytes, records: int, repeats: int) -> dict[str, float]:
    """Median microseconds per record to sign it and to validate and strip it."""
    writer = Identity.generate()
    signer, reader = SignedRecordValidator(writer), SignedRecordValidator(Identity.generate())
    unsigned = [DHTRecord(DHTID.generate(source=stage_key("bench", 0)).to_bytes(),
                          MSGPackSerializer.dumps(writer.peer_id), MSGPackSerializer.dumps(body),
                          1e9 + index) for index in range(records)]
    sign_us, check_us = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        signed = [replace(record, value=signer.sign_value(record)) for record in unsigned]
        middle = time.perf_counter()
        for record in signed:
            if not reader.validate(record):
                raise RuntimeError(f"a record was refused: {reader.refused}")
            reader.strip_value(record)
        end = time.perf_counter()
        sign_us.append((middle - start) / records * 1e6)
        check_us.append((end - middle) / records * 1e6)
    sign, check = statistics.median(sign_us), statistics.median(check_us)
    return {"sign_us": sign, "validate_us": check, "total_us": sign + check}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="decentrl bench record-signing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--records", type=int, default=2000, help="records per timed run")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs (the median is kept)")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args(argv)
    if args.records < 1 or args.repeats < 1:
        parser.error(f"--records and --repeats must be >= 1, got {args.records}, {args.repeats}")
    results = {name: time_records(body, args.records, args.repeats)
               for name, body in BODIES.items()}
    common.print_table("signing and checking one DHT record (microseconds)",
                       ["body", "bytes", "sign", "validate", "sum"],
                       [[name, len(BODIES[name]), r["sign_us"], r["validate_us"], r["total_us"]]
                        for name, r in results.items()])
    figures = {f"{name}_{key}": value for name, r in results.items() for key, value in r.items()}
    common.print_figures("record-signing", figures)
    common.write_json(args.json, {"figures": figures})


if __name__ == "__main__":
    main()
