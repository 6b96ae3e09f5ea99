"""The report's markdown sections, one module per stage that has results to show (train, judge, eval) plus the
closing sections of the report stage. Each section is a function `frames -> list of markdown lines` starting with
its "## Title"; a section without data says which command produces it. The stages in benchctl.stages decide which
sections appear and in what order."""
