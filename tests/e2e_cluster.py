"""The small emulated cluster of the end-to-end test, for the pure tests of the pieces it uses.

2 nodes, 3 devices: two at share 0.5 on a 1 Gbit/s NIC, one at 0.25 on 100 Mbit/s
(``tests/distributed/test_end_to_end.py`` runs on the same).
"""

CLUSTER = {
    "name": "e2e",
    "node": [
        {"name": "fast", "devices": [{"type": "cpu", "cpu_share": 0.5, "count": 2}], "intra_link": "loopback",
         "nic": "1Gbit/s"},
        {"name": "slow", "devices": [{"type": "cpu", "cpu_share": 0.25}], "intra_link": "loopback",
         "nic": "100Mbit/s"},
    ],
}
