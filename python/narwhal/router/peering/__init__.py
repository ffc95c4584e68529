"""Active routers (`ha.mode: active`): what each tells the others of its work (`wire`,
`exchange`), and the others' work held in its own picture of the fleet (`elsewhere`)."""
