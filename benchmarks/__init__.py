"""The benchmarks that bench.py runs. A part (datapath, mixing, training, preparing, evaluating,
gpu; listed in bench.py's PARTS) is a module with TITLE; run(small, device, workdir), which
returns its "results" rows, "targets" and any "settings"; plot(result), a matplotlib Figure; and
TABLES, the columns of the tables that its page text, benchmarks/text/<part>.md, places.
datapath_rank, prepare_reference, prepare_llmc_reference and minimal_loop are programs that
parts launch; report.py writes the page."""
