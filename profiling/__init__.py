"""`tandem profile`: per-device measurements of an engine directory, a report (JSON, HTML with
plots, Chrome trace), and the verify width per batch size tuned from them."""
