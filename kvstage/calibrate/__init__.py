"""`kvstage calibrate`: measure this machine (`measure`), fit the points (`fit`,
`posting`, `inrun`) and write the hardware profile (`profile`)."""
