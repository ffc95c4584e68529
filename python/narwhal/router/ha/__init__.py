"""Several routers on etcd: who leads (`leadership`), which engines are out of placement
(`maintenance`), and what the leader's predictor learned (`profiles`)."""
