//! A link model for the in-process communicator: the bandwidth and latency of each mesh axis's
//! links, so a collective between threads (a memory copy) takes the time it would take on that
//! link, and communication that training does not hide becomes measurable on one machine.
//!
//! A collective of `n` members moving `S` bytes takes, by the ring algorithms NCCL and MPI use for
//! large messages (α the latency, β the bandwidth):
//!
//! | call | time |
//! |---|---|
//! | all-reduce of `S` | 2(n−1)/n · S/β + 2(n−1)·α |
//! | all-gather of `S/n` per member (`S` out) | (n−1)/n · S/β + (n−1)·α |
//! | reduce-scatter of `S` in | (n−1)/n · S/β + (n−1)·α |
//! | broadcast of `S` | S/β + ⌈log₂ n⌉·α |
//! | barrier | ⌈log₂ n⌉·α |

use std::collections::BTreeMap;
use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use super::CollectiveKind;

/// One kind of link: bytes per second and the latency of one message.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LinkModel {
    /// Bytes per second, per direction.
    pub bandwidth: f64,
    /// One message's latency.
    pub latency: Duration,
}

impl LinkModel {
    /// NVLink 4 (H100 SXM): 450 GB/s per direction, 2 µs.
    pub const NVLINK: LinkModel = LinkModel {
        bandwidth: 450e9,
        latency: Duration::from_micros(2),
    };
    /// InfiniBand NDR, one 400 Gb/s port per GPU: 50 GB/s, 5 µs.
    pub const INFINIBAND: LinkModel = LinkModel {
        bandwidth: 50e9,
        latency: Duration::from_micros(5),
    };
    /// 10 Gb Ethernet with TCP: 1.25 GB/s, 30 µs.
    pub const ETHERNET: LinkModel = LinkModel {
        bandwidth: 1.25e9,
        latency: Duration::from_micros(30),
    };

    /// The time a collective of `kind` among `n` members takes on this link, `bytes` being what
    /// each member passes in (the communicators' counted bytes: the buffer, or for a broadcast
    /// the broadcast buffer). See the module docs.
    pub fn collective_time(&self, kind: CollectiveKind, n: usize, bytes: u64) -> Duration {
        if n <= 1 {
            return Duration::ZERO;
        }
        let (steps, volume) = {
            let (n, s) = (n as f64, bytes as f64);
            match kind {
                CollectiveKind::AllReduce => (2.0 * (n - 1.0), 2.0 * (n - 1.0) / n * s),
                // Each member passes S/n in: (n − 1) · S/n bytes go past it.
                CollectiveKind::AllGather => (n - 1.0, (n - 1.0) * s),
                CollectiveKind::ReduceScatter => (n - 1.0, (n - 1.0) / n * s),
                CollectiveKind::Broadcast => (n.log2().ceil(), s),
                CollectiveKind::Barrier => (n.log2().ceil(), 0.0),
                CollectiveKind::Send | CollectiveKind::Recv => (1.0, s),
                // A message to each other member; about (n − 1)/n of the buffer leaves it.
                CollectiveKind::AllToAll => (n - 1.0, (n - 1.0) / n * s),
            }
        };
        self.latency.mul_f64(steps) + Duration::from_secs_f64(volume / self.bandwidth)
    }
}

impl fmt::Display for LinkModel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{}GB/s,{}us",
            self.bandwidth / 1e9,
            self.latency.as_secs_f64() * 1e6
        )
    }
}

/// `nvlink`, `infiniband`, `ethernet`, or `<bandwidth>,<latency>` with units: `25GB/s,5us`,
/// `100Gb/s,2us`, `800MB/s,1ms`.
impl FromStr for LinkModel {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "nvlink" => return Ok(Self::NVLINK),
            "infiniband" | "ib" => return Ok(Self::INFINIBAND),
            "ethernet" => return Ok(Self::ETHERNET),
            _ => {}
        }
        let bad = || {
            format!(
                "link {s:?}: expected nvlink, infiniband, ethernet or BANDWIDTH,LATENCY \
                 (e.g. 25GB/s,5us)"
            )
        };
        let (bandwidth, latency) = s.split_once(',').ok_or_else(bad)?;
        let number = |text: &str, units: &[(&str, f64)]| -> Result<f64, String> {
            let text = text.trim();
            let (value, scale) = units
                .iter()
                .find_map(|(unit, scale)| text.strip_suffix(unit).map(|v| (v, *scale)))
                .ok_or_else(bad)?;
            let value: f64 = value.trim().parse().map_err(|_| bad())?;
            (value.is_finite() && value >= 0.0)
                .then_some(value * scale)
                .ok_or_else(bad)
        };
        let bandwidth = number(
            bandwidth,
            &[
                ("GB/s", 1e9),
                ("Gb/s", 1e9 / 8.0),
                ("MB/s", 1e6),
                ("Mb/s", 1e6 / 8.0),
                ("kB/s", 1e3),
                ("B/s", 1.0),
            ],
        )?;
        let latency = number(
            latency,
            &[("us", 1e-6), ("ns", 1e-9), ("ms", 1e-3), ("s", 1.0)],
        )?;
        if bandwidth == 0.0 {
            return Err(bad());
        }
        Ok(LinkModel {
            bandwidth,
            latency: Duration::from_secs_f64(latency),
        })
    }
}

/// The links of a mesh's axes, by axis name (`dp=25GB/s,5us`, `tp=nvlink`); an axis without one
/// moves data as fast as memory does. A group over several axes (the world) goes at its slowest.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Links(pub BTreeMap<String, LinkModel>);

impl Links {
    /// Parse `AXIS=LINK` (see [`LinkModel`]'s `FromStr`) and add it.
    pub fn add(&mut self, spec: &str) -> Result<(), String> {
        let (axis, link) = spec
            .split_once('=')
            .ok_or_else(|| format!("link {spec:?}: expected AXIS=LINK, e.g. dp=25GB/s,5us"))?;
        self.0.insert(axis.trim().to_string(), link.parse()?);
        Ok(())
    }

    /// The link a group labelled `label` (an axis name, or `world` and the like) runs over.
    pub fn for_group(&self, label: &str) -> Option<&LinkModel> {
        self.0.get(label).or_else(|| {
            self.0
                .values()
                .min_by(|a, b| a.bandwidth.total_cmp(&b.bandwidth))
        })
    }

    /// Whether no axis has a link.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_parse_and_price_collectives() {
        let link: LinkModel = "25GB/s,5us".parse().unwrap();
        assert_eq!(link.bandwidth, 25e9);
        assert_eq!(link.latency, Duration::from_micros(5));
        assert_eq!(
            "100Gb/s,2us".parse::<LinkModel>().unwrap().bandwidth,
            12.5e9
        );
        assert_eq!("nvlink".parse::<LinkModel>().unwrap(), LinkModel::NVLINK);
        for bad in ["25GB/s", "fast,5us", "25GB/s,5", "0GB/s,1us", "-1GB/s,1us"] {
            assert!(bad.parse::<LinkModel>().is_err(), "{bad}");
        }
        // All-reduce of 100 MB over 4 members at 25 GB/s, 5 µs: 2·3/4·100e6/25e9 s + 6·5 µs.
        let t = link.collective_time(CollectiveKind::AllReduce, 4, 100_000_000);
        assert!((t.as_secs_f64() - (0.006 + 30e-6)).abs() < 1e-9, "{t:?}");
        // An all-gather of 25 MB per member moves what a reduce-scatter of 100 MB does.
        let gather = link.collective_time(CollectiveKind::AllGather, 4, 25_000_000);
        let scatter = link.collective_time(CollectiveKind::ReduceScatter, 4, 100_000_000);
        assert_eq!(gather, scatter);
        assert_eq!(
            link.collective_time(CollectiveKind::Barrier, 4, 0),
            Duration::from_micros(10)
        );
        assert_eq!(
            link.collective_time(CollectiveKind::AllReduce, 1, 1 << 30),
            Duration::ZERO
        );
        let mut links = Links::default();
        links.add("dp=ethernet").unwrap();
        links.add("tp=nvlink").unwrap();
        assert_eq!(links.for_group("tp"), Some(&LinkModel::NVLINK));
        assert_eq!(links.for_group("world"), Some(&LinkModel::ETHERNET));
        assert!(links.add("dp:nvlink").is_err());
    }
}
