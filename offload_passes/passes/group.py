"""Pass 2 — group sites by their top-k producer (IndexShare groups), in graph order.

Sites sharing one indexer call form a group; the owner is the site that consumes the producer first
(the first gather in graph order), the last layer is the group's last site. Singleton groups are
normal; no period or pattern is assumed.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from .detect import DetectReport, Site


@dataclass
class Group:
    group_id: int
    producer: fx.Node
    sites: list[Site]

    @property
    def owner(self) -> Site:
        return self.sites[0]

    @property
    def last(self) -> Site:
        return self.sites[-1]

    @property
    def layers(self) -> list[int]:
        return [s.layer for s in self.sites]


@dataclass
class GroupReport:
    groups: list[Group]


def group(det: DetectReport) -> GroupReport:
    by_producer: dict[fx.Node, list[Site]] = {}
    for s in det.sites:  # sites are in graph order already
        by_producer.setdefault(s.producer, []).append(s)
    ordered = sorted(by_producer.items(), key=lambda kv: kv[1][0].layer)
    return GroupReport([Group(i, p, sites) for i, (p, sites) in enumerate(ordered)])
