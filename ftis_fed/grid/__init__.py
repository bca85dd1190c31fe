"""``ftis-fed grid``'s engine room: plan (which cells), run (resumable, compacted), records (a cell's
files), metric (greedy or sampled pass@1), stats (paired intervals, the verdict rule), tables, claims
(the verdicts, as data) and report (markdown, CSV, figures). ``ftis_fed.commands.experiment`` is its
command line."""
