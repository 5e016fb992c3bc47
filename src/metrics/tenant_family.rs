//! A family of series labelled by tenant, and by at most one more label of a
//! fixed set (a reason, an outcome), kept as plain numbers.
//!
//! A `prometheus` vector's child clones its family's description (name,
//! help, label names) and label pairs: about 2 KB a series, which with
//! 10,000 tenants, three or four series each, was 75 MiB. Here a series is
//! one map entry (its tenant, its second label, its value). A scrape writes
//! the series as text straight from the map ([`TenantFamily::write_text`]),
//! the same text as the crate's encoder, without building the crate's model
//! of 10,000 tenants' series first (a string per label, then the encoder's
//! copies: most of a scrape's time).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::{Mutex, PoisonError};

use prometheus::core::{Collector, Desc};
use prometheus::proto::{Counter, Gauge, LabelPair, Metric, MetricFamily, MetricType};

/// Each tenant's values by second label ("" without one).
type Values = BTreeMap<Box<str>, Vec<(&'static str, f64)>>;

/// Counter or gauge series by (tenant, second label).
pub struct TenantFamily {
    desc: Desc,
    kind: MetricType,
    /// The second label's name, if the family has one.
    second: Option<&'static str>,
    /// Each tenant's values by second label ("" without one), in the
    /// order a scrape writes them.
    values: Mutex<Values>,
}

impl TenantFamily {
    /// A counter family, labelled `tenant` (and `second`).
    pub fn counter(name: &str, help: &str, second: Option<&'static str>) -> TenantFamily {
        TenantFamily::new(name, help, MetricType::COUNTER, second)
    }

    /// A gauge family, labelled `tenant`.
    pub fn gauge(name: &str, help: &str) -> TenantFamily {
        TenantFamily::new(name, help, MetricType::GAUGE, None)
    }

    fn new(name: &str, help: &str, kind: MetricType, second: Option<&'static str>) -> TenantFamily {
        let labels = std::iter::once("tenant")
            .chain(second)
            .map(str::to_string)
            .collect();
        TenantFamily {
            desc: Desc::new(name.into(), help.into(), labels, Default::default())
                .expect("valid metric"),
            kind,
            second,
            values: Mutex::new(BTreeMap::new()),
        }
    }

    fn values(&self) -> std::sync::MutexGuard<'_, Values> {
        self.values.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Applies `change` to the series (made at 0 first if need be).
    fn update(&self, tenant: &str, second: &'static str, change: impl FnOnce(&mut f64)) {
        let mut values = self.values();
        let series = match values.get_mut(tenant) {
            Some(series) => series,
            None => values.entry(tenant.into()).or_default(),
        };
        let at = match series.binary_search_by(|(name, _)| name.cmp(&second)) {
            Ok(at) => at,
            Err(at) => {
                series.insert(at, (second, 0.0));
                at
            }
        };
        change(&mut series[at].1);
    }

    /// Adds `n` to the series (made at 0 first if need be).
    pub fn add(&self, tenant: &str, second: &'static str, n: f64) {
        self.update(tenant, second, |value| *value += n);
    }

    /// Shows the series, at 0 if it is new.
    pub fn touch(&self, tenant: &str, second: &'static str) {
        self.update(tenant, second, |_| {});
    }

    /// Sets the series (made first if need be).
    pub fn set(&self, tenant: &str, value: f64) {
        self.update(tenant, "", |old| *old = value);
    }

    /// Whether `tenant` has a series in this family.
    pub fn contains(&self, tenant: &str) -> bool {
        self.values().contains_key(tenant)
    }

    /// Sets to 0 every series of a tenant `keep` does not name.
    pub fn zero_unless(&self, keep: impl Fn(&str) -> bool) {
        for (tenant, series) in self.values().iter_mut() {
            if !keep(tenant) {
                for (_, value) in series.iter_mut() {
                    *value = 0.0;
                }
            }
        }
    }

    /// Writes the family in the Prometheus text format, as the crate's
    /// `TextEncoder` writes its [`Collector::collect`]: `# HELP`, `# TYPE`,
    /// then each series, labels in the order of their names. The series are
    /// locked while they are written (about a millisecond for 10,000
    /// tenants), which is why the scrape runs off the sweeping thread.
    pub fn write_text(&self, out: &mut String) {
        let name = &self.desc.fq_name;
        let kind = if self.kind == MetricType::COUNTER {
            "counter"
        } else {
            "gauge"
        };
        out.push_str("# HELP ");
        out.push_str(name);
        out.push(' ');
        escape(out, &self.desc.help, false);
        out.push_str("\n# TYPE ");
        out.push_str(name);
        out.push(' ');
        out.push_str(kind);
        out.push('\n');
        // The second label goes first when its name sorts before `tenant`.
        let second_first = self.second.is_some_and(|second| second < "tenant");
        let values = self.values();
        for (tenant, series) in values.iter() {
            for (second_value, value) in series {
                out.push_str(name);
                out.push('{');
                let second = self.second.map(|second| (second, *second_value));
                if let Some((label, value)) = second.filter(|_| second_first) {
                    label_pair(out, label, value);
                    out.push(',');
                }
                label_pair(out, "tenant", tenant);
                if let Some((label, value)) = second.filter(|_| !second_first) {
                    out.push(',');
                    label_pair(out, label, value);
                }
                // As the encoder writes it: `f64`'s `Display`.
                let _ = writeln!(out, "}} {value}");
            }
        }
    }

    /// The series' value, if it exists.
    #[cfg(test)]
    pub fn get(&self, tenant: &str, second: &'static str) -> Option<f64> {
        let values = self.values();
        let series = values.get(tenant)?;
        series
            .iter()
            .find(|(name, _)| *name == second)
            .map(|(_, value)| *value)
    }
}

/// `name="value"`, the value escaped.
fn label_pair(out: &mut String, name: &str, value: &str) {
    out.push_str(name);
    out.push_str("=\"");
    escape(out, value, true);
    out.push('"');
}

/// The text format's escapes: backslash and newline (and a double quote in
/// a label value).
fn escape(out: &mut String, text: &str, quote: bool) {
    if !text.contains(['\\', '\n', '"']) {
        out.push_str(text);
        return;
    }
    for c in text.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '"' if quote => out.push_str("\\\""),
            c => out.push(c),
        }
    }
}

impl Collector for TenantFamily {
    fn desc(&self) -> Vec<&Desc> {
        vec![&self.desc]
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let mut family = MetricFamily::default();
        family.set_name(self.desc.fq_name.clone());
        family.set_help(self.desc.help.clone());
        family.set_field_type(self.kind);
        let label = |name: &str, value: &str| {
            let mut pair = LabelPair::default();
            pair.set_name(name.to_string());
            pair.set_value(value.to_string());
            pair
        };
        let values = self.values();
        let metrics = family.mut_metric();
        metrics.reserve(values.len());
        for (tenant, second, value) in values.iter().flat_map(|(tenant, series)| {
            series
                .iter()
                .map(move |(second, value)| (tenant, second, value))
        }) {
            let mut labels = vec![label("tenant", tenant)];
            if let Some(name) = self.second {
                labels.push(label(name, second));
            }
            // In the order of their names, as the `prometheus` vectors write them.
            labels.sort_by(|a, b| a.name().cmp(b.name()));
            let mut metric = Metric::default();
            metric.set_label(labels);
            if self.kind == MetricType::COUNTER {
                let mut counter = Counter::default();
                counter.set_value(*value);
                metric.set_counter(counter);
            } else {
                let mut gauge = Gauge::default();
                gauge.set_value(*value);
                metric.set_gauge(gauge);
            }
            metrics.push(metric);
        }
        vec![family]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The text written straight from the numbers is the encoder's text
    /// of the same family, byte for byte: odd tenant names, both orders of
    /// the labels, fractions, counters and gauges.
    #[test]
    fn the_text_is_the_encoders_text() {
        let reasons = TenantFamily::counter("r_total", "Help \\ with\nlines.", Some("reason"));
        let zones = TenantFamily::counter("z_total", "Help.", Some("zone"));
        let gauge = TenantFamily::gauge("g", "Help.");
        let empty = TenantFamily::gauge("e", "Nothing yet.");
        for tenant in [
            "a",
            "quo\"te",
            "back\\slash",
            "new\nline",
            "ünï",
            "{x=\"y\"}",
        ] {
            reasons.add(tenant, "nack", 3.0);
            reasons.touch(tenant, "timeout");
            zones.add(tenant, "eu", 1.0);
            gauge.set(tenant, 0.125);
        }
        gauge.set("big", 12_345_678_901.5);
        for family in [&reasons, &zones, &gauge, &empty] {
            let mut text = String::new();
            family.write_text(&mut text);
            let collected = family.collect();
            let expected = if collected[0].get_metric().is_empty() {
                // The encoder writes nothing for a family without series:
                // the relay writes its `# HELP` and `# TYPE` alone.
                "# HELP e Nothing yet.\n# TYPE e gauge\n".to_string()
            } else {
                prometheus::TextEncoder::new()
                    .encode_to_string(&collected)
                    .unwrap()
            };
            assert_eq!(text, expected);
        }
    }

    #[test]
    fn series_are_kept_as_numbers_and_written_in_order() {
        let family = TenantFamily::counter("x_total", "Help.", Some("reason"));
        family.add("b", "nack", 2.0);
        family.add("a", "nack", 1.0);
        family.add("b", "nack", 3.0);
        family.touch("a", "timeout");
        assert_eq!(family.get("b", "nack"), Some(5.0));
        assert_eq!(family.get("c", "nack"), None);
        let collected = family.collect();
        let metrics = collected[0].get_metric();
        let shown: Vec<(String, String, f64)> = metrics
            .iter()
            .map(|m| {
                (
                    m.get_label()[1].value().to_string(),
                    m.get_label()[0].value().to_string(),
                    m.get_counter().get_value(),
                )
            })
            .collect();
        assert_eq!(
            shown,
            [
                ("a".into(), "nack".into(), 1.0),
                ("a".into(), "timeout".into(), 0.0),
                ("b".into(), "nack".into(), 5.0)
            ]
        );
        let gauge = TenantFamily::gauge("g", "Help.");
        gauge.set("t", 7.5);
        gauge.set("t", 2.5);
        assert_eq!(gauge.get("t", ""), Some(2.5));
        assert!(gauge.contains("t") && !gauge.contains("u"));
        gauge.set("u", 1.0);
        gauge.zero_unless(|tenant| tenant == "u");
        assert_eq!(gauge.get("t", ""), Some(0.0), "kept, at 0");
        assert_eq!(gauge.get("u", ""), Some(1.0));
        assert_eq!(gauge.collect()[0].get_metric()[0].get_label().len(), 1);
    }
}
