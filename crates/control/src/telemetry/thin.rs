//! Thinning a sample series to one sample per step, the step growing with the range asked.

use vmon_proto::node::MetricSample;

/// The step (seconds) for a query spanning `range_secs`: 5 s under 1 h, 30 s under 6 h, 60 s
/// under 12 h, 120 s under 24 h, 300 s under 7 days, else 900 s.
pub fn step_for(range_secs: i64) -> i64 {
    const H: i64 = 3600;
    match range_secs {
        r if r < H => 5,
        r if r < 6 * H => 30,
        r if r < 12 * H => 60,
        r if r < 24 * H => 120,
        r if r < 7 * 24 * H => 300,
        _ => 900,
    }
}

/// Keeps the first sample of every `step`-second bucket (buckets aligned to the epoch, so
/// consecutive queries agree). `samples` must be ordered by time.
pub fn thin(samples: Vec<MetricSample>, step: i64) -> Vec<MetricSample> {
    let step = step.max(1);
    let mut out: Vec<MetricSample> = Vec::with_capacity(samples.len());
    let mut last_bucket = None;
    for s in samples {
        let bucket = s.timestamp_unix.div_euclid(step);
        if last_bucket != Some(bucket) {
            last_bucket = Some(bucket);
            out.push(s);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(start: i64, end: i64, every: i64) -> Vec<MetricSample> {
        (start..end)
            .step_by(every as usize)
            .map(|t| MetricSample {
                timestamp_unix: t,
                cpu_count: 2,
                cpu_used_pct: 1.0,
                mem_used: 1,
                mem_total: 2,
                mem_cache: 0,
                disk_used: 1,
                disk_total: 2,
            })
            .collect()
    }

    #[test]
    fn steps_grow_with_the_range() {
        let h = 3600;
        for (range, step) in [
            (0, 5),
            (h - 1, 5),
            (h, 30),
            (6 * h - 1, 30),
            (6 * h, 60),
            (12 * h - 1, 60),
            (12 * h, 120),
            (24 * h - 1, 120),
            (24 * h, 300),
            (7 * 24 * h - 1, 300),
            (7 * 24 * h, 900),
            (30 * 24 * h, 900),
        ] {
            assert_eq!(step_for(range), step, "range {range}");
        }
    }

    #[test]
    fn one_sample_per_step() {
        // Two hours of 5 s samples thinned at the 30 s step: one per 30 s bucket.
        let start = 1_700_000_010;
        let samples = series(start, start + 7200, 5);
        assert_eq!(samples.len(), 1440);
        let step = step_for(7200);
        assert_eq!(step, 30);
        let thinned = thin(samples, step);
        assert_eq!(thinned.len(), 240);
        for w in thinned.windows(2) {
            assert_eq!(w[1].timestamp_unix - w[0].timestamp_unix, 30);
        }
        assert!(thinned.iter().all(|s| s.timestamp_unix % 30 == 0));
    }

    #[test]
    fn every_step_thins_a_week_of_samples() {
        let start = 1_700_000_000 - (1_700_000_000 % 900);
        let week = series(start, start + 7 * 24 * 3600, 5);
        for step in [5, 30, 60, 120, 300, 900] {
            let thinned = thin(week.clone(), step);
            assert_eq!(thinned.len() as i64, 7 * 24 * 3600 / step, "step {step}");
        }
    }

    #[test]
    fn gaps_and_jitter_keep_one_per_bucket() {
        let mut s = series(100, 160, 5);
        s.extend(series(1000, 1010, 3));
        let thinned = thin(s, 30);
        let ts: Vec<i64> = thinned.iter().map(|s| s.timestamp_unix).collect();
        assert_eq!(ts, vec![100, 120, 150, 1000]);
    }
}
