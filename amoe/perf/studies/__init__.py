"""Studies of the performance model: the planner's plans run on the emulated runtime and compared with their
predictions (`plan_check`, `plan_table`, `plan_scale`), the scheduling policies compared (`policy_bench`,
`policy_itl`), AEP against EP on emulated deployments (`compare`, with `compare_setup`, `compare_report`, `steady`,
`point`, `probe`, `calibrate`, `plots`), and published figures reproduced (`frontier`, `frontier_trace`,
`chrome_trace`, `eps_paper`, `eps_bench`). Every command is registered in `commands`. They start servers (through
amoe.testing.servers) and drive them with amoe.bench's load generator; nothing below this floor imports them.
"""
