"""Notebook-first, executable reproduction of compliant LLM pretraining (Apertus, Soofi S).

Modules:

- `openpretrain.compliance.robots`: Retroactive robots.txt compliance (Apertus §3.1.1, App. B): the matching primitive (Protego 0.7), the policy for missing files, per-URL and per-domain decisions, a datatrove filter that records each decision in the compliance ledger, the host ranking, and a polite asynchronous fetcher. Reads a robots.txt snapshot (a DataFrame or Parquet, such as chapter 01's) and the documents' URLs; writes a snapshot Parquet only when `write_snapshot` is called.
- `openpretrain.corpus`: The embedded corpus at run time: loaders for the committed `data/` (documents in the FineWeb-2 schema, the aligned UDHR, the KJV memorisation probes, the January-2025 robots.txt snapshot) and for real FineWeb Parquet or hub datasets, the token and word counts, language and script identification, and the facts the robots.txt snapshot is read against (AI crawler names, the parser byte cap, registrable domains). Reads `data/` (or FineWeb); writes nothing — `openpretrain.build` (01b) writes `data/`."""

__version__ = "0.1.0"
